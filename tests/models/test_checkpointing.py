"""Activation checkpointing keeps less for the backward pass and gives the plain path's numbers.

The rule for speed and memory levers (they never change results silently): log-probs and gradients with
``trainer.gradient_checkpointing`` equal the plain pass's, for a full model and under LoRA, in the
RL update and in SFT; it really checkpoints (the saved-tensor total falls, and both trainers' models
carry the flag), so these equalities are not comparing the plain path with itself; and frozen bottom
layers (``optim.trainable_layers``) stay out of the backward pass.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from ragen.cli import main
from ragen.config import load_config
from ragen.models import apply_lora
from ragen.models.checkpointing import enable_checkpointing, is_checkpointing
from ragen.models.freeze import decoder_layers, train_top_layers
from ragen.sft.config import load_sft_config
from ragen.sft.trainer import SFTTrainer
from ragen.train import actor_update as update_module
from ragen.train.logprobs import decoder_hidden, policy_forward
from ragen.train.trainer import StarPOTrainer

from tests.train.trajectories import shared_prompt_trajectories


def batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 24), generator=g)  # (B, L)
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0  # a right-padded row
    response = torch.zeros(3, 23)  # (B, T = L - 1)
    response[:, 10:] = 1
    response[0, -5:] = 0
    return ids, mask, response


def decoder_saved_bytes(model, ids, mask) -> int:
    """Bytes autograd saves for the backward pass of the decoder stack (parameters excluded; the LM head,
    whose saved logits dominate a tiny model's total, is not part of what checkpointing drops)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decoder_hidden(model, ids, mask)
    return sum(saved.values())


def backward(model, ids, mask, response):
    """Log-probs and gradients by name of a loss with a policy and an entropy term."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = policy_forward(model, ids, mask, response, with_entropy=True)
    (-(out.logprobs * response).sum() - 0.1 * out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), grads


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointed_pass_saves_less_and_gives_the_same_gradients(tiny, lora, monkeypatch):
    # a checkpointed model keeps sdpa (its recompute runs outside policy_forward's attention switch):
    # the plain pass does too here, so that the two differ only by checkpointing
    import ragen.train.logprobs as logprobs

    real_switch = logprobs.train_attention_for
    monkeypatch.setattr(logprobs, "train_attention_for", lambda model, enabled=True: real_switch(model, enabled=False))
    plain = copy.deepcopy(tiny[0])
    if lora:
        plain = apply_lora(plain, rank=4, alpha=8.0)
        for name, p in plain.named_parameters():  # random adapters, so that their gradients are not trivially tied
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    checkpointed = copy.deepcopy(plain)
    enable_checkpointing(checkpointed)
    ids, mask, response = batch(plain.config.vocab_size)
    saved_plain, saved_checkpointed = decoder_saved_bytes(plain, ids, mask), decoder_saved_bytes(checkpointed, ids, mask)
    assert saved_checkpointed < 0.2 * saved_plain, (saved_plain, saved_checkpointed)  # it really checkpoints
    logp_a, grads_a = backward(plain, ids, mask, response)
    logp_b, grads_b = backward(checkpointed, ids, mask, response)
    torch.testing.assert_close(logp_b, logp_a, rtol=0, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    assert all(("lora_" in n) == lora for n in grads_a)  # under LoRA only adapters train
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)


def test_generation_is_unchanged_by_checkpointing(tiny, tokenizer):
    """ragen generates in eval mode (HFBackend switches to it), where no transformers release checkpoints."""
    plain = copy.deepcopy(tiny[0])
    checkpointed = copy.deepcopy(plain)
    enable_checkpointing(checkpointed)
    prompt = tokenizer("Arms: Gambler, Clerk", return_tensors="pt")
    outs = []
    for model in (plain, checkpointed):
        model.eval()
        with torch.no_grad():
            outs.append(model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id))
    assert torch.equal(*outs)


def test_frozen_bottom_layers_stay_out_of_the_backward_pass(tiny):
    """With ``optim.trainable_layers`` autograd stops at the first trainable layer, checkpointing or not
    (transformers' own switch also makes the embeddings' output require grad, which would undo that)."""
    model = copy.deepcopy(tiny[0])
    train_top_layers(model, 1)
    enable_checkpointing(model)
    layers = decoder_layers(model)
    needs_grad = {}
    for i in (0, len(layers) - 1):
        layers[i].register_forward_hook(
            lambda module, args, out, i=i: needs_grad.__setitem__(i, (out[0] if isinstance(out, tuple) else out).requires_grad))
    ids, mask, response = batch(model.config.vocab_size)
    backward(model, ids, mask, response)
    assert needs_grad == {0: False, len(layers) - 1: True}  # no graph through the frozen layer below


def test_rl_update_with_checkpointing_matches_the_plain_update(tmp_path, monkeypatch):
    """Same gradients, loss and grad norm in one update, with the same call from the trainer."""
    calls: dict[bool, list] = {False: [], True: []}
    real = update_module.policy_forward
    grads, metrics = {}, {}
    for flag in (False, True):
        def recording(*args, _flag=flag, **kw):
            if torch.is_grad_enabled():
                calls[_flag].append(kw.get("prompt_lengths"))
            return real(*args, **kw)

        monkeypatch.setattr(update_module, "policy_forward", recording)
        config = load_config("bandit", ["model=tiny", "trainer.precision=fp32", f"trainer.output_dir={tmp_path / str(flag)}",
                                        "trainer.val_episodes=1", f"trainer.gradient_checkpointing={flag}"])
        trainer = StarPOTrainer(config)
        assert is_checkpointing(trainer.model) is flag
        trainer.optimizer.step = lambda *a, **k: None  # keep the (clipped) gradients for the comparison
        torch.manual_seed(0)
        metrics[flag] = trainer.update(shared_prompt_trajectories(trainer.tokenizer))
        grads[flag] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    # The trainer asks for the shared-prompt pass either way; on the checkpointed model decoder_hidden
    # runs full rows instead (test_shared_prompts_fall_back_to_full_rows_on_a_checkpointed_model).
    assert calls[False] and all(p is not None for p in calls[False]) and len(calls[True]) == len(calls[False])
    for got, want in zip(calls[True], calls[False]):
        assert torch.equal(got, want)
    assert metrics[False]["actor/grad_norm"] > 0
    for key in ("actor/grad_norm", "actor/loss"):
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-5), key
    assert grads[True].keys() == grads[False].keys() and grads[False]
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-8, msg=name)


def test_shared_prompts_fall_back_to_full_rows_on_a_checkpointed_model(tiny, tokenizer):
    """decoder_hidden itself refuses the prompt cache on a checkpointed model in training mode."""
    from tests.train.trajectories import _batch_with_shared_prompts

    model = copy.deepcopy(tiny[0])
    enable_checkpointing(model)
    model.train()
    b = _batch_with_shared_prompts(tokenizer)
    shared = policy_forward(model, b.input_ids, b.attention_mask, b.response_mask, prompt_lengths=b.response_mask.argmax(dim=1) + 1)
    plain = policy_forward(model, b.input_ids, b.attention_mask, b.response_mask)
    torch.testing.assert_close(shared.logprobs, plain.logprobs, rtol=0, atol=0)  # the same full-row pass


def test_sft_with_checkpointing_logs_the_plain_run_s_losses(tmp_path):
    data = tmp_path / "bandit.jsonl"
    assert main(["sft", "generate", "bandit", "--n", "6", "--out", str(data)]) == 0
    for flag in (False, True):
        config = load_sft_config(None, [f"data.path={data}", "model=tiny", f"trainer.output_dir={tmp_path / f'built_{flag}'}",
                                        f"trainer.gradient_checkpointing={flag}"])
        assert is_checkpointing(SFTTrainer(config).model) is flag
    runs = {}
    for flag in ("false", "true"):
        run = tmp_path / f"sft_{flag}"
        assert main(["sft", "train", str(data), "model=tiny", "trainer.progress_bar=false", "trainer.batch_size=4",
                     "trainer.micro_batch_size=2", "trainer.max_steps=2", "trainer.precision=fp32", "optim.lr=1e-2",
                     f"trainer.gradient_checkpointing={flag}", f"trainer.output_dir={run}"]) == 0
        runs[flag] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in runs["true"]] == [m["step"] for m in runs["false"]] == [0, 1, 2]
    for a, b in zip(runs["false"], runs["true"]):
        for key in ("train/loss", "train/grad_norm", "eval/loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), key
