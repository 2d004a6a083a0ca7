"""Grouped-query attention as explicit fp32 matmuls for the update's masked, small attention calls on the CPU.

For a training or scoring pass with a padding mask, transformers' ``sdpa`` integration first copies
every KV head to its ``g`` query heads (``repeat_kv``) and then calls torch's CPU flash kernel, whose
backward is slow at small shapes. :func:`grouped_attention` computes

    O = softmax(Q Kᵀ · s + M) V          (per KV head, its g query heads stacked: no KV copies)

with ``Q Kᵀ``, the softmax and ``P V`` in fp32 (autocast off inside; bf16 inputs are upcast), so it is,
if anything, less rounded than the bf16 flash kernel (tests: output and gradients against float64).

Where it pays, measured on a 2-core AMD EPYC with AVX-512 BF16 (``benchmarks/bench_update.py``): the main job's update (prompt passes of ~4 × 111 tokens, continuations of 16 ×
~10 on ~121 keys, both masked) 1.23-1.27x faster. Where it does not: calls without a mask, which
``sdpa`` runs on the KV heads directly (``enable_gqa``) with the causal half skipped (an explicit 2 ×
108-token prompt pass made a whole update ~5 % slower), and large calls (16 × 64 queries × 172 keys:
no faster in a whole update, though 1.7x per layer alone; its ``(B, H, q, L)`` fp32 tensors are fresh
memory each time). Hence :func:`train_attention` takes this path only with a 4-d mask, while
``B·H·q·L ≤`` :data:`MAX_SCORES`, on the CPU, without dropout, soft-capping, sinks or any argument it
does not know, and hands every other call to transformers' ``sdpa`` unchanged. The bound also caps the
probabilities kept for the backward at 4 MB per layer (flash keeps ``(B, H, q)``). Rows whose every
key is masked (left padding) get the mean of the values where torch's sdpa returns zeros: finite
either way, and such rows are padding, never read by a loss. :func:`train_attention_for`
switches a model to it for a ``with`` block (:func:`ragen.train.logprobs.policy_forward` does so around
the decoder, except on a checkpointed model, whose backward recomputes layers outside the block).
"""

from __future__ import annotations

import torch
from ragen.models.attention_switch import attention_switch, harmless, register, with_sdpa_fallback

#: The name under which transformers' attention and mask registries know this implementation.
NAME = "ragen_grouped"

#: Largest ``B · H · q · L`` (elements of one layer's probabilities) computed explicitly: 4 MB of fp32. 2**20 since
#: the packed shared-prompt layout (ragen/train/packed_groups.py), whose main-job calls (4 rows × 9 heads × ~135²)
#: sit between 2**19 and 2**20: the main job's update 1.13x faster than at 2**19 (``benchmarks/bench_update.py``,
#: alternated rounds); calls of 16 × 9 × 64 × 172 ≈ 1.6 M stay with sdpa (measured no faster here).
MAX_SCORES = 2**20


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scaling: float, causal: bool = False) -> torch.Tensor:
    """``softmax(q kᵀ · scaling + mask) v`` in fp32 per KV head; returns ``(B, q, H, Dv)`` like transformers' ``sdpa``.

    ``query`` ``(B, H, q, D)``; ``key``/``value`` ``(B, H_kv, L, D / Dv)`` with ``H = g · H_kv`` (query head
    ``h`` reads KV head ``h // g``). ``mask``: boolean (True = attend) or additive float, broadcastable to
    ``(B, 1, q, L)``; ``None`` with ``causal`` masks keys after each query (aligned to the last key).
    """
    B, H, Q, D = query.shape
    kv_heads, L = key.shape[1], key.shape[2]
    g = H // kv_heads
    lowest = torch.finfo(torch.float32).min
    device = query.device.type
    # sdpa's output dtype: autocast's under autocast (q and k may arrive fp32 from RoPE, v in bf16), else the query's
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    with torch.autocast(device, enabled=False):
        q = query.float().reshape(B, kv_heads, g * Q, D)  # (B, H_kv, g·q, D): a KV head's query heads stacked
        scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scaling)  # (B, H_kv, g·q, L)
        scores = scores.view(B, kv_heads, g, Q, L)  # (B, H_kv, g, q, L)
        if mask is None and causal:
            mask = torch.ones(Q, L, dtype=torch.bool, device=query.device).tril_(L - Q)  # (q, L)
        if mask is not None:
            mask = mask[:, :, None] if mask.dim() == 4 else mask  # (B or 1, 1, q, L) -> (B or 1, 1, 1, q, L): every head
            if mask.dtype == torch.bool:
                # as masked_fill(~mask, lowest), bit for bit while |score| < 1e31 (lowest + score rounds to lowest),
                # and 10x+ faster: masked_fill broadcasting a (B, 1, 1, q, L) mask ran at ~4 GB/s here. (A NaN or
                # inf score at a masked key now stays, as with an additive float mask; masked_fill replaced it.)
                mask = (mask.float() - 1).mul_(-lowest)  # 0 where attended, lowest elsewhere
            scores = scores + mask.float()
        probs = torch.softmax(scores, dim=-1).view(B, kv_heads, g * Q, L)  # (B, H_kv, g·q, L)
        out = torch.matmul(probs, value.float())  # (B, H_kv, g·q, Dv)
    return out.view(B, H, Q, -1).transpose(1, 2).to(out_dtype).contiguous()  # (B, q, H, Dv)


def _fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, dropout: float,
          kwargs: dict) -> bool:
    """True when :func:`grouped_attention` computes what ``sdpa`` would for this call, within the memory bound."""
    B, H, Q, D = query.shape
    if query.device.type != "cpu" or dropout != 0.0 or H % key.shape[1] != 0 or key.shape[-1] != D:
        return False
    if value.shape[:3] != key.shape[:3] or key.shape[0] != B or B * H * Q * key.shape[2] > MAX_SCORES:
        return False
    # Without a mask sdpa runs the flash kernel on the KV heads (enable_gqa) and skips the causal half:
    # measured faster than this path (a 2 x 108-token prompt pass); with one it copies the KV heads first.
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 \
            or attention_mask.shape[0] not in (1, B):
        return False
    return harmless(kwargs)


train_attention = with_sdpa_fallback(
    _fits, lambda query, key, value, mask, scale: grouped_attention(query, key, value, mask, scale),
    "transformers attention function: :func:`grouped_attention` where it fits, ``sdpa`` otherwise.")


register(NAME, train_attention)


def train_attention_for(model, enabled: bool = True):
    """Within the block, a CPU model that uses ``sdpa`` attends with :func:`train_attention`; yields whether it does
    (:func:`~ragen.models.attention_switch.attention_switch`)."""
    return attention_switch(model, NAME, enabled)
