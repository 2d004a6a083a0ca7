"""The fused decode step's grouped path in C++ (:mod:`ragen.models.native`): one call for all layers and the head.

:func:`ragen.models.fused_decode.decode_step` hands a step here when :func:`can_run` says the C++ kernel computes it:
bf16 on oneDNN-packed weights, a :class:`~ragen.models.shared_prefix.SharedPrefix` step that reads every own column
per group (:func:`~ragen.models.shared_prefix._attend_grouped`), a cache of :class:`GrowingLayer`\\ s holding fp32
keys and bf16 values. Python keeps the bookkeeping (the buffers' growth, the group mask, the cache's views); the
kernel computes the 30 layers without returning to Python. Same arithmetic as the Python step up to float rounding
(``tests/models/test_native_decode.py``).

Measured on the 2-core Zen 5 EPYC (bf16, SmolLM2-135M, batch 32, groups of 4, 32 new tokens; calls alternated in one
process): ``docs/performance.md``, "native (C++) grouped step".
"""

from __future__ import annotations

import warnings

import torch

from ragen.models.growing_cache import GrowingLayer

#: The kernel's largest head dimension (``kMaxHeadDim`` in ``csrc/decode_step.cpp``); wider heads decode in Python.
MAX_HEAD_DIM = 512


#: Set when the kernel raised during a step (its first error): every later step of the process runs in Python.
failed: str | None = None


def can_run(weights, cache, prefix, model=None) -> bool:
    """Whether :func:`grouped_step` computes this step (the caller already checked the step is a grouped one)."""
    if failed is not None or weights.dtype != torch.bfloat16 or not weights.all_packed:
        return False
    if model is not None and model.model.embed_tokens.weight.dtype != torch.float32:  # the residual stream's dtype
        return False
    # filled_views: the kernel only writes the cache (its prefix columns are read from ``prefix``), so a row copy that
    # GrowingLayer.reorder_cache deferred stays deferred
    views = [layer.filled_views() if type(layer) is GrowingLayer else (None, None) for layer in cache.layers]
    if not all(keys is not None and keys.dim() == 4 for keys, _ in views):
        return False
    keys, values = views[0]
    head_dim = keys.shape[-1]
    return (head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM and keys.dtype == torch.float32 and values.dtype == torch.bfloat16
            and weights.norm.dtype == torch.float32 and all(w.norm_in.dtype == torch.float32 for w in weights.layers)
            and prefix.keys_t[0].dtype == torch.float32)


def grouped_step(ops, model, weights, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, cache, prefix,
                 past: int) -> torch.Tensor:
    """Logits ``(B, V)`` bf16 of one grouped decode step: ``h`` ``(B, C)`` fp32 embeddings, ``cos``/``sin_signed``
    ``(B | 1, 1, D)`` fp32; the step's keys and values appended to ``cache`` (column ``past``) and ``prefix``.

    None if the kernel refused the step (warned once; :data:`failed` keeps later steps in Python): the cache and
    ``prefix`` then hold no new column, only room for one, and the caller computes the step in Python."""
    global failed
    config = model.config
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    D = cos.shape[-1]
    prefix.make_grouped_bias(H // H_kv, h.device)
    n = 0
    for i in range(len(weights.layers)):
        n = prefix.reserve_own(i)
    for layer in cache.layers:
        if layer.reserve(1) != past:
            raise RuntimeError(f"cache layer holds {layer.get_seq_length()} columns, the step expects {past}")
    try:
        logits = _call(ops, weights, h, cos, sin_signed, cache, prefix, n, past, H, H_kv, D)
    except RuntimeError as error:  # a check in the kernel refused the step: nothing is advanced yet, Python redoes it
        failed = str(error).splitlines()[0] if str(error) else type(error).__name__
        warnings.warn(f"ragen: the native decode step failed ({failed}); decoding in Python from here on",
                      stacklevel=2)
        return None
    for layer in cache.layers:
        layer.advance(1)
    prefix.own_steps += 1
    return logits


def _call(ops, weights, h, cos, sin_signed, cache, prefix, n: int, past: int, H: int, H_kv: int, D: int):
    L = weights.layers
    return ops.decode_grouped(
        h, cos, sin_signed, [w.norm_in for w in L], [w.eps_in for w in L], [w.qkv.weight for w in L],
        [w.qkv.bias for w in L], [w.o.weight for w in L], [w.o.bias for w in L], [w.norm_post for w in L],
        [w.eps_post for w in L], [w.gate_up.weight for w in L], [w.down.weight for w in L], prefix.keys_t,
        prefix.values, [layer._key_buffer for layer in cache.layers], [layer._value_buffer for layer in cache.layers],
        prefix.grouped_bias, prefix.group, n - prefix.group, past, H, H_kv, D ** -0.5, weights.norm, weights.norm_eps,
        weights.head.weight)  # (B, V)
