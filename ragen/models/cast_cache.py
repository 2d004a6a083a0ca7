"""Frozen fp32 weights cast to bf16 once per ``generate`` call instead of once per decode step.

Under ``torch.autocast`` every fp32 weight is cast to bf16 by each op that uses it. Autocast keeps
the cast for the rest of its block only for leaf tensors that require grad (``cached_cast`` in
ATen's ``autocast_mode.cpp``): a trained model's weights are cast once per ``generate``, but frozen
ones -- the base weights of a LoRA model, a Ray rollout worker's model (``requires_grad_(False)``) --
are cast again at every decode step, reading 540 MB of fp32 and writing
270 MB of bf16 per step for SmolLM2-135M. On a 2-core AMD EPYC (AVX-512 BF16) casting them once made
``generate`` 1.23-1.37x faster with LoRA (rank 8) and 1.04-1.39x with the whole model frozen, at
batch 32 and 64 (``benchmarks/bench_decode.py``).

:func:`frozen_weights_cast_once` marks the frozen fp32 parameters as requiring grad for a ``with``
block, so autocast caches their casts too, and restores them on exit (also on error). It acts only
where that is invisible: inside autocast, with autograd off (no graph can record the flag), so the
numbers computed are the same -- the same casts, made fewer times. "Autograd off" is the calling
thread's state while ``requires_grad`` belongs to the tensors: the block assumes no other thread runs
a training forward on the same model meanwhile (ragen generates and trains on one thread; Ray rollout
workers are processes of their own).
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def frozen_weights_cast_once(model: torch.nn.Module, device_type: str = "cpu", enabled: bool = True):
    """Within the block, autocast caches the bf16 casts of ``model``'s frozen fp32 parameters; yields how many."""
    switch = enabled and torch.is_autocast_enabled(device_type) and not torch.is_grad_enabled()
    frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32] if switch else []
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield len(frozen)
    finally:
        for p in frozen:
            p.requires_grad_(False)
