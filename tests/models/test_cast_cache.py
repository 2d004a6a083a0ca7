"""Frozen weights are cast to bf16 once per ``generate`` under autocast, with the same results."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ragen.models.backend as backend
from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.cast_cache import frozen_weights_cast_once


class WeightCasts(TorchDispatchMode):
    """Counts fp32 → bf16 casts of the given parameters (by storage) that reach the dispatcher."""

    def __init__(self, params):
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16 \
                and args[0].dtype == torch.float32 and args[0].data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **kwargs)


def frozen_tiny():
    model, tokenizer = load_model("tiny")
    return model.eval().requires_grad_(False), tokenizer


def casts_over_two_forwards(model, switch: bool) -> tuple[int, int]:
    """(weight casts counted, distinct linear weights)."""
    ids = torch.tensor([[1, 2, 3, 4]])
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), WeightCasts(linears) as counter:
        with frozen_weights_cast_once(model) if switch else contextlib.nullcontext():
            model(input_ids=ids)
            model(input_ids=ids)
    return counter.count, len({w.data_ptr() for w in linears})


def test_frozen_weights_are_cast_once_across_forwards():
    model, _ = frozen_tiny()
    plain, n_weights = casts_over_two_forwards(model, switch=False)
    cached, _ = casts_over_two_forwards(model, switch=True)
    assert plain == 2 * n_weights  # without the switch: every forward casts every linear's weight again
    assert cached == n_weights


def test_flags_are_restored_after_the_block_and_on_error():
    model, _ = frozen_tiny()
    model.lm_head.weight.requires_grad_(True)  # tied to the embedding: one trained tensor among frozen ones
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with frozen_weights_cast_once(model) as n:
            assert n == sum(not r for r in before.values()) > 0
            assert all(p.requires_grad for p in model.parameters())
        with pytest.raises(RuntimeError, match="boom"), frozen_weights_cast_once(model):
            raise RuntimeError("boom")
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before


@pytest.mark.parametrize("autocast,grad", [(False, False), (True, True)])
def test_no_switch_outside_autocast_or_with_autograd_on(autocast, grad):
    """With autograd on the flag would reach the graph; without autocast there is nothing to cache."""
    model, _ = frozen_tiny()
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with frozen_weights_cast_once(model) as n:
            assert n == 0 and not any(p.requires_grad for p in model.parameters())


def test_bf16_generation_of_a_frozen_model_is_unchanged(monkeypatch):
    """Through HFBackend: the same sampled tokens with the switch as without it, far fewer weight casts, flags restored."""
    model, tokenizer = frozen_tiny()
    prompts = [tokenizer("Which arm do you pull?")["input_ids"], tokenizer("Go left.")["input_ids"]] * 3
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    casts = []

    def generate():
        torch.manual_seed(0)
        with WeightCasts(linears) as counter:
            # transformers' modules at every step (the fused decode step casts its own copy once: test_fused_decode.py)
            gens = HFBackend(model, tokenizer, precision="bf16", reuse_kv=False, fused_decode=False).generate(prompts, params)
        casts.append(counter.count)
        return [g.token_ids for g in gens]

    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return frozen_weights_cast_once(*args, **kwargs)

    monkeypatch.setattr(backend, "frozen_weights_cast_once", counting)
    switched = generate()
    monkeypatch.setattr(backend, "frozen_weights_cast_once", lambda *a, **k: contextlib.nullcontext(0))
    plain = generate()
    assert calls and switched == plain
    n_weights = len({w.data_ptr() for w in linears})
    assert casts[0] == n_weights  # once per generate call (one batch: one autocast block)
    assert casts[1] >= 10 * n_weights  # once per forward: the prefill and each decode step
    assert not any(p.requires_grad for p in model.parameters())
