"""``agent.context_mode=window`` through the trainer: one training row per turn, advantages from the episodes."""

import json
import math
from collections import Counter

import pytest
import torch

from ragen.algos.advantages import group_normalized_scores
from ragen.cli import main
from ragen.config import load_config
from ragen.train.trainer import StarPOTrainer

WINDOW = ["model=tiny", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "agent.max_turn=3",
          "agent.context_mode=window", "agent.max_context_window=1", "trainer.val_episodes=2",
          "trainer.progress_bar=false", "trainer.val_before_train=false", "trainer.save_final=false",
          "trainer.plot=false"]


@pytest.mark.parametrize("estimator", ["grpo", "gae", "gigpo"])
def test_ragen_train_in_window_mode(estimator, tmp_path):
    extra = ["algorithm.ppo_epochs=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2"]
    assert main(["train", "sokoban", f"trainer.output_dir={tmp_path}", "trainer.total_steps=2",
                 f"algorithm.adv_estimator={estimator}", *WINDOW, *extra]) == 0
    last = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and math.isfinite(last["actor/grad_norm"]) and math.isfinite(last["actor/loss"])
    if estimator == "gae":  # the critic always has something to learn
        assert "critic/explained_variance" in last and last["actor/grad_norm"] > 0


def test_window_rows_carry_their_episodes_advantages(tmp_path):
    """GRPO in window mode: every turn row of an episode gets that episode's group-normalised return
    (groups count episodes, not turns), on exactly the row's sampled tokens."""
    config = load_config("sokoban", [f"trainer.output_dir={tmp_path}", "algorithm.adv_estimator=grpo", *WINDOW])
    trainer = StarPOTrainer(config)
    trajectories = trainer.rollout(1)
    # give the group rewards some spread, so normalised advantages are not all zero
    for i, traj in enumerate(trajectories):
        traj.turns[-1].env_reward += float(i)
    seen = []
    trainer.actor.optimizer_step = lambda batch, targets, **kwargs: seen.append((batch, targets)) or {"actor/loss": 0.0}
    trainer.update(trajectories)
    [(rows, targets)] = seen

    turns = [(e, k) for e, t in enumerate(trajectories) for k, (s, end) in enumerate(t.turn_spans) if end > s]
    assert len(rows) == len(turns) > len(trajectories)
    scores = torch.tensor([t.reward for t in trajectories])
    groups = torch.tensor([t.group_id for t in trajectories])
    expected = group_normalized_scores(scores, groups, norm_by_std=True, eps=1e-6)
    # rows arrive shuffled (the update's permutation): compare multisets of (row ids, advantages on its tokens)
    got = Counter()
    for r in range(len(rows)):
        n = int(rows.attention_mask[r].sum())
        mask = rows.response_mask[r].bool()
        assert torch.all(targets.advantages[r][~mask] == 0)
        got[(tuple(rows.input_ids[r, :n].tolist()), tuple(round(float(a), 4) for a in targets.advantages[r][mask]))] += 1
    want = Counter()
    for e, k in turns:
        traj = trajectories[e]
        s, end = traj.turn_spans[k]
        want[(tuple(traj.window_prompts[k] + traj.input_ids[s:end]), (round(float(expected[e]), 4),) * (end - s))] += 1
    assert got == want


def test_the_rollout_log_records_each_turns_window_for_the_viewer(tmp_path):
    # the viewer showed the whole-episode ids as the context of every turn: the log lacked what each turn saw
    assert main(["train", "sokoban", f"trainer.output_dir={tmp_path}", "trainer.total_steps=1", "trainer.log_rollouts_freq=1",
                 "trainer.log_rollouts_n=4", *WINDOW]) == 0
    records = [json.loads(line) for line in (tmp_path / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert records and any(len(r["turns"]) >= 3 for r in records)
    for record in records:
        prompts, spans, tokens = record["window_prompts"], record["turn_spans"], record["tokens"]
        assert len(prompts) == len(spans) == len(record["turns"])
        assert prompts[0] == tokens[: spans[0][0]]  # turn 1's window is the episode's own prompt
        for k, (start, end) in enumerate(spans):
            assert record["loss_mask"][start:end] == [1] * (end - start)  # a span is the turn's model-written ids
            if k >= 2:  # a window of 1 turn: shorter than the whole history before the turn
                assert len(prompts[k]) < start
    from ragen.viz.viewer import build_site

    page = (build_site(tmp_path).parent / "step_000001" / "traj_0000.html").read_text()
    assert "does not record the turns' window prompts" not in page  # the viewer has them to show
