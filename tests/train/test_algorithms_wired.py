"""Every registered estimator, and every stabiliser, runs through ``ragen train`` on the tiny model."""

import json

import pytest

from ragen.algos import ADV_ESTIMATORS
from ragen.cli import main

SMALL = ["model=tiny", "trainer.total_steps=2", "rollout.env_groups=2", "rollout.group_size=2",
         "rollout.max_new_tokens=6", "agent.max_turn=2", "trainer.val_episodes=2", "trainer.progress_bar=false",
         "trainer.val_before_train=false", "trainer.save_final=false",
         "trainer.plot=false"]  # (curves.png costs ~1.2 s a run; tests/viz draws it)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("estimator", sorted(ADV_ESTIMATORS))
def test_every_estimator_trains_on_sokoban(estimator, tmp_path):
    assert main(["train", "sokoban", f"algorithm.adv_estimator={estimator}", f"trainer.output_dir={tmp_path}", *SMALL]) == 0
    last = _metrics(tmp_path)[-1]
    assert last["step"] == 2 and "actor/grad_norm" in last
    if estimator in ("gae", "bi_level_gae"):
        assert "critic/explained_variance" in last


@pytest.mark.parametrize(
    "extra",
    [
        ["algorithm.ppo_epochs=2", "algorithm.mini_batch_size=2", "algorithm.micro_batch_size=1"],
        ["algorithm.use_kl_loss=true", "algorithm.kl_type=k3"],
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_type=k1", "lora.rank=4"],
        ["algorithm.filter_ratio=0.5", "algorithm.filter_mode=top_k"],
        ["algorithm.filter_ratio=0.5", "algorithm.filter_mode=top_p_ragen"],
        ["algorithm.use_turn_rewards=true", "algorithm.adv_estimator=reinforce_pp"],
        ["algorithm.loss_agg_mode=seq-mean-token-sum", "algorithm.adv_estimator=dr_grpo", "algorithm.clip_ratio_c=3.0"],
    ],
    ids=["ppo-epochs", "kl-loss", "kl-reward-lora", "filter", "filter-ragen-rule", "turn-rewards", "dr-grpo-dual-clip"],
)
def test_stabilisers_and_update_modes(extra, tmp_path):
    assert main(["train", "sokoban", f"trainer.output_dir={tmp_path}", *SMALL, *extra]) == 0
    last = _metrics(tmp_path)[-1]
    if "algorithm.use_kl_loss=true" in extra:
        assert "actor/kl_loss" in last
    if "algorithm.filter_mode=top_k" in extra:
        assert last["filter/kept_ratio"] == pytest.approx(0.5)
    if "algorithm.filter_mode=top_p_ragen" in extra:  # no group kept (none has reward spread) skips the update
        assert last["filter/kept_ratio"] == 0.0 or "actor/grad_norm" in last


def test_rollouts_are_logged_with_token_level_detail(tmp_path):
    assert main(["train", "sokoban", f"trainer.output_dir={tmp_path}", *SMALL, "trainer.log_rollouts_freq=1",
                 "trainer.log_rollouts_n=3"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    for rec in lines:
        assert len(rec["tokens"]) == len(rec["loss_mask"]) == len(rec["advantages"])
        assert rec["turns"] and rec["initial_observation"]
        assert all(a == 0.0 for a, m in zip(rec["advantages"], rec["loss_mask"]) if not m)
