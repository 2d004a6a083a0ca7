"""The update's CPU speed-ups change nothing but the time: on every tiny architecture, ``policy_forward`` with them
(shared prompts run once, grouped attention, the hand-written LM-head backward, the kept tied-weight gradient) gives
the plain transformers path's log-probs, entropy and gradients (``algorithm.fast_update=false``), in fp32."""

from __future__ import annotations

import pytest
import torch

from ragen.cli import main
from ragen.models import load_model
from ragen.models.dropout import disable_config_dropout, disable_dropout
from ragen.train import actor_update
from ragen.train.logprobs import policy_forward
from tests.models.test_architectures import ARCHITECTURES, build
from tests.train.trajectories import _batch_with_shared_prompts


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny")[1]


def forward_and_grads(model, batch, fast: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(logprobs (B, T), entropy (B, T), gradients by name)`` of a loss that weighs every target differently."""
    model.zero_grad(set_to_none=True)
    out = policy_forward(model, batch.input_ids, batch.attention_mask, batch.response_mask, temperature=0.8,
                         with_entropy=True, entropy_grad=False, prompt_lengths=batch.response_mask.argmax(1) + 1,
                         fast=fast)
    weights = torch.linspace(-1.0, 1.0, batch.response_mask.numel()).view_as(batch.response_mask)  # (B, T)
    (out.logprobs * weights * batch.response_mask).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), out.entropy.detach(), grads


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_fast_update_equals_the_plain_path(arch, tokenizer, tmp_path):
    model, tok = load_model(build(arch, tokenizer, tmp_path / "model"))
    disable_dropout(model)  # as the trainer does (algorithm.disable_dropout): GPT-2's dropout would differ per pass
    disable_config_dropout(model)
    model.train()
    batch = _batch_with_shared_prompts(tok)
    fast_logp, fast_entropy, fast_grads = forward_and_grads(model, batch, fast=True)
    plain_logp, plain_entropy, plain_grads = forward_and_grads(model, batch, fast=False)
    mask = batch.response_mask.bool()
    assert mask.sum() > 0
    torch.testing.assert_close(fast_logp[mask], plain_logp[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_entropy[mask], plain_entropy[mask], atol=1e-5, rtol=1e-5)
    assert fast_grads.keys() == plain_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        scale = grad.abs().max().clamp(min=1e-8)
        assert (fast_grads[name] - grad).abs().max() <= 1e-4 * scale, name


def test_fast_update_false_reaches_every_forward_of_a_run(tmp_path, monkeypatch):
    seen = []
    real = actor_update.policy_forward
    monkeypatch.setattr(actor_update, "policy_forward", lambda *a, **k: seen.append(k.get("fast")) or real(*a, **k))
    assert main(["train", "bandit", "model=tiny", "algorithm.fast_update=false", "trainer.total_steps=1",
                 "trainer.val_episodes=1", "rollout.env_groups=2", "rollout.group_size=2", "algorithm.use_kl_loss=true",
                 "algorithm.entropy_coeff=0.01", f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress_bar=false",
                 "trainer.plot=false", "trainer.save_final=false"]) == 0
    assert seen and set(seen) == {False}  # the reference's scoring pass and the update's
