"""An update whose advantages are all zero skips the backward pass and still leaves exactly what the full update leaves."""

import copy

import pytest
import torch

from ragen.config import load_config
from ragen.train.trainer import StarPOTrainer

from tests.train.trajectories import shared_prompt_trajectories

BASE = ["model=tiny", "trainer.val_episodes=1", "optim.lr=1e-3", "optim.weight_decay=0.01",
        "algorithm.ppo_epochs=2", "algorithm.mini_batch_size=3", "algorithm.micro_batch_size=2",
        "algorithm.use_kl_loss=false"]  # a KL loss has a gradient of its own


def uniform_rewards(trajs, per_group=(1.0, 0.0)):
    """Every group's episodes get the same reward: GRPO's advantages are then exactly 0."""
    out = copy.deepcopy(trajs)
    for t in out:
        turn = t.turns[-1]
        turn.env_reward, turn.format_penalty = per_group[t.group_id], 0.0
    return out


def build(tmp_path, name, extra=()):
    return StarPOTrainer(load_config("bandit", [*BASE, f"trainer.output_dir={tmp_path / name}", *extra]))


def test_zero_advantages_skip_backward_and_match_the_full_update_bit_for_bit(tmp_path, monkeypatch):
    skip, full = build(tmp_path, "skip"), build(tmp_path, "full")
    varied = shared_prompt_trajectories(skip.tokenizer)  # rewards differ inside each group
    for trainer in (skip, full):  # a real step first, so AdamW's moments are non-zero
        torch.manual_seed(1)
        assert trainer.update(varied)["actor/backward_skipped"] == 0.0
    uniform = uniform_rewards(varied)
    before = {n: p.detach().clone() for n, p in skip.model.named_parameters()}
    monkeypatch.setattr(full.actor, "gradient_is_zero", lambda advantages: False)  # force the backward pass
    backward_calls = []
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "backward", lambda self, *a, **k: backward_calls.append(1))
        torch.manual_seed(2)
        m_skip = skip.update(uniform)
    assert backward_calls == []  # not one backward pass in 2 epochs x 2 mini-batches
    torch.manual_seed(2)
    m_full = full.update(uniform)

    assert m_skip.pop("actor/backward_skipped") == 1.0 and m_full.pop("actor/backward_skipped") == 0.0
    assert m_skip.keys() == m_full.keys()
    for key in m_full:
        assert m_skip[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-7), key
    assert m_full["actor/grad_norm"] == 0.0  # the full pass computed exact zeros too
    for (name, p_skip), (_, p_full) in zip(skip.model.named_parameters(), full.model.named_parameters()):
        assert torch.equal(p_skip, p_full), name
    assert any(not torch.equal(p, before[n]) for n, p in skip.model.named_parameters())  # AdamW still stepped
    for (p_s, p_f) in zip(skip.actor.trainable_parameters(), full.actor.trainable_parameters()):
        for slot, value in full.optimizer.state[p_f].items():
            assert torch.equal(skip.optimizer.state[p_s][slot], value), slot
    assert skip.scheduler.last_epoch == full.scheduler.last_epoch


@pytest.mark.parametrize("extra", [(), ("algorithm.entropy_coeff=0.01",), ("algorithm.use_kl_loss=true",),
                                   ("algorithm.adv_estimator=gae",)])
def test_backward_runs_whenever_the_gradient_may_be_non_zero(tmp_path, extra):
    trainer = build(tmp_path, "t", extra)
    trajs = shared_prompt_trajectories(trainer.tokenizer)
    if extra:  # zero advantages, but an entropy bonus, a KL loss or a critic has a gradient of its own
        trajs = uniform_rewards(trajs)
    metrics = trainer.update(trajs)
    assert metrics["actor/backward_skipped"] == 0.0 and metrics["actor/grad_norm"] > 0
