"""Attention for one query token as two small matmuls, for decoding on the CPU.

During decoding each sequence brings one new token: attention is ``softmax(q kᵀ · s + mask) v`` with
``q`` of shape ``(B, H, 1, D)`` against the cache's ``(B, H_kv, L, D)``. When every row has the same
length, transformers passes no mask and asks torch's CPU "flash" kernel for grouped-query attention
with one query per head, which is slow on a CPU: measured on a 2-core AMD EPYC (AVX-512 BF16, no
AMX) at SmolLM2's decode shape (9 query heads, 3 KV heads, D = 64, L ≈ 135, bf16), 1.6-1.8 ms per
call at batch 32 against ~0.1-0.2 ms for the two matmuls below, and ``generate``'s decode time
1.35× (batch 16) and 1.67× (batch 32) that of this path (fp32 matmuls, at 2292685). With a padding mask transformers packs
the query heads per KV head first and the kernel is as fast as this path (0.98-1.03×), so masked
calls stay with ``sdpa``.
``benchmarks/bench_decode.py --sections attention``.

:func:`decode_attention` computes the same quantity (grouped-query heads without copying the KV
heads, softmax in fp32 like the flash kernel's accumulators; inputs upcast to fp32, so it is, if
anything, less rounded than the bf16 kernel; autocast is switched off inside, so the matmuls stay
fp32 under ``generate``'s bf16 autocast) and hands every other call (prompt prefill, training,
a padding mask, dropout, soft-capping, attention sinks, any extra argument it does not know) to transformers' own
``sdpa`` function unchanged. :func:`decode_attention_for` switches a model to it for a ``with``
block -- :class:`~ragen.models.backend.HFBackend` does so around ``generate`` -- and back on exit.
"""

from __future__ import annotations

import torch
from ragen.models.attention_switch import attention_switch, harmless, register, with_sdpa_fallback

#: The name under which transformers' attention and mask registries know this implementation.
NAME = "ragen_decode"


def grouped_one_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                      padding: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q kᵀ · scaling) v`` in fp32 with a KV head's query heads together: ``query`` ``(B, H_kv, g, D)``,
    ``key``/``value`` ``(B, H_kv, L, D)``, ``padding`` ``(B, 1, 1, L)`` (True = masked) or None; ``(B, H_kv, g, Dv)``.

    Call it with autocast off (the matmuls would otherwise run in bf16).
    """
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)).mul_(scaling)  # (B, H_kv, g, L)
    if padding is not None:
        scores.masked_fill_(padding, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), value.float())  # (B, H_kv, g, Dv)


def one_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """``softmax(q kᵀ · scaling) v`` for one query token per row, unmasked; returns ``(B, 1, H, D)`` like ``sdpa``.

    ``query`` is ``(B, H, 1, D)``; ``key``/``value`` are ``(B, H_kv, L, D)`` with ``H = g · H_kv``
    (query head ``h`` reads KV head ``h // g``, as transformers' ``repeat_kv``).
    """
    B, H, _, D = query.shape
    kv_heads = key.shape[1]
    with torch.autocast(query.device.type, enabled=False):  # fp32 even inside generate's bf16 autocast
        q = query.reshape(B, kv_heads, H // kv_heads, D)  # (B, H_kv, g, D): a KV head's query heads together
        out = grouped_one_query(q, key, value, scaling)  # (B, H_kv, g, Dv)
    return out.reshape(B, 1, H, value.shape[-1]).to(query.dtype)  # (B, 1, H, Dv): sdpa's layout after its transpose


def _fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, dropout: float, kwargs: dict) -> bool:
    """True when :func:`one_query_attention` computes exactly what ``sdpa`` would for this call."""
    if query.shape[2] != 1 or query.shape[1] % key.shape[1] != 0 or key.shape[-1] != query.shape[-1] \
            or value.shape[:3] != key.shape[:3]:
        return False
    if attention_mask is not None or dropout != 0.0 or torch.is_grad_enabled() or query.device.type != "cpu":
        return False
    return harmless(kwargs)


decode_attention = with_sdpa_fallback(
    _fits, lambda query, key, value, mask, scale: one_query_attention(query, key, value, scale),
    "transformers attention function: :func:`one_query_attention` for unmasked one-token decode calls, ``sdpa`` otherwise.")


register(NAME, decode_attention)


def decode_attention_for(model, enabled: bool = True):
    """Within the block, a CPU model that uses ``sdpa`` attends with :func:`decode_attention`; yields whether it does
    (:func:`~ragen.models.attention_switch.attention_switch`)."""
    return attention_switch(model, NAME, enabled)
