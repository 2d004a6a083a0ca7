"""Prompt prefill of Llama-family models through the fused decode step's weights, for generation on the CPU.

A rollout's ``generate`` call first runs its prompts through the model for their keys and values
(``HFBackend._prompt_pass``), then decodes with :func:`~ragen.models.fused_decode.decode_step` on
:class:`~ragen.models.fused_weights.FusedWeights`: the projections concatenated (``[W_q; W_k; W_v]``,
``[W_gate; W_up]``), cast to bf16 and packed for oneDNN once per rollout. Through transformers' modules the
prefill used none of that: seven separate projections per layer, each weight cast again by autocast, GEMMs
repacking plain weights. :func:`prefill` runs the same prompt tokens through the packed weights the decode
steps use (built once for both), with torch's ``scaled_dot_product_attention`` reading the KV heads directly
(``enable_gqa``, no repeated keys).

The arithmetic is transformers' under autocast, dtype for dtype: an fp32 residual stream and RMS norms,
projections in the autocast dtype, rotary embedding from the model's own ``rotary_emb`` in fp32 (so the
cached keys are fp32 and the values bf16, as transformers caches them), and attention in bf16 (autocast casts
``sdpa``'s inputs to bf16). The mask is the causal mask and the padding mask together, as transformers builds
it; a query that is itself padding (it may see no real key) also attends to its own column, so no row of the
softmax is empty whatever the kernel does with one. That matters beyond the padding row: torch 2.13's kernel
returns zeros for an empty row, but a NaN there would go into that padding column's keys and values, and a real
query that masks the column still multiplies its value by a probability of 0 (0 · NaN = NaN). Equal to
transformers' prefill up to float rounding (packed GEMMs may sum in another order; the tests bound it:
``tests/models/test_fused_prefill.py``). Measured by ``benchmarks/bench_decode.py``.

Taken only where :func:`~ragen.models.fused_decode.unsupported_reason` takes the decode steps, with a plain
per-layer KV cache (:func:`~ragen.models.growing_cache.plain_layers`) and explicit positions; the backend runs every other prefill through
transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ragen.models.fused_decode import _rms_norm, _rotate, head_logits, mlp_residual, signed_sin
from ragen.models.fused_weights import FusedWeights


def attention_mask_4d(attention_mask: torch.Tensor, queries: int) -> torch.Tensor:
    """``(B, 1, T, P + T)`` bool: query ``i`` (column ``P + i``) may read column ``j`` if ``j ≤ P + i`` and ``j`` is
    real (``attention_mask`` ``(B, P + T)``, 1 = real), and always its own column."""
    B, width = attention_mask.shape
    past = width - queries
    causal = torch.ones(queries, width, dtype=torch.bool, device=attention_mask.device).tril(diagonal=past)  # (T, P+T)
    allowed = causal[None] & attention_mask.bool()[:, None, :]  # (B, T, P+T)
    own = torch.arange(queries, device=attention_mask.device)
    allowed[:, own, past + own] = True  # a padding query reads itself: no empty softmax row
    return allowed[:, None]


#: Most tokens (rows × columns) one pass runs: a longer prefill runs in column chunks of ``PASS_TOKENS // B``, each
#: appending its keys and values to the cache before the next reads them. Whole, a long batch's activations are
#: tens of MB each (fresh pages at every op) and its masked attention computes every query against every column,
#: the causal half too; in chunks a pass's tensors stay small and a chunk's queries meet only the columns up to its
#: own. Measured on a 2-core Zen 5 (``benchmarks/bench_decode.py``): 16 prompts
#: of ~560 tokens 1.29-1.39× faster at 1 024-4 096 tokens a pass, 64 of ~260 1.5-1.7×.
PASS_TOKENS = 2048


@torch.no_grad()
def prefill(model, weights: FusedWeights, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            position_ids: torch.Tensor, cache=None, last: bool = False):
    """Append the keys and values of ``input_ids`` ``(B, T)`` at ``position_ids`` ``(B, T)`` to ``cache`` (``P``
    columns per layer; None: a new ``DynamicCache``); returns ``(cache, logits)``: with ``last`` the logits at each
    row's last column ``(B, V)`` (final norm and LM head, as :func:`~ragen.models.fused_decode.decode_step`), else
    None. ``attention_mask`` is ``(B, P + T)`` (1 = real, 0 = padding) or None (every column real). Runs in column
    chunks of at most :data:`PASS_TOKENS` tokens a pass (:func:`in_column_chunks`): the same keys and values up to
    float rounding."""
    run = lambda ids, mask, positions, cache, last: _pass(model, weights, ids, mask, positions, cache, last)  # noqa: E731
    return in_column_chunks(run, input_ids, attention_mask, position_ids, cache, last)


def in_column_chunks(run, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                     cache=None, last: bool = False):
    """``run(ids, mask, positions, cache, last) -> (cache, logits)``, a prompt pass appending to ``cache`` (None: it
    makes one), over ``input_ids`` ``(B, T)`` in column chunks of at most :data:`PASS_TOKENS` tokens: each chunk
    with the mask of the columns so far and ``last`` only for the final one. One call when ``B·T`` fits."""
    B, T = input_ids.shape
    width = max(1, PASS_TOKENS // B)  # columns a pass
    if T <= width:
        return run(input_ids, attention_mask, position_ids, cache, last)
    past = cache.get_seq_length() if cache is not None else 0
    logits = None
    for start in range(0, T, width):
        end = min(T, start + width)
        mask = attention_mask[:, : past + end] if attention_mask is not None else None  # the columns so far
        cache, logits = run(input_ids[:, start:end], mask, position_ids[:, start:end], cache, last and end == T)
    return cache, logits


def _pass(model, weights: FusedWeights, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
          position_ids: torch.Tensor, cache, last: bool):
    """One pass of :func:`prefill` over all of ``input_ids``' columns."""
    inner, config = model.model, model.config
    B, T = input_ids.shape
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    q_width, kv_width = H * D, H_kv * D
    scaling = D ** -0.5
    dtype = weights.dtype
    if cache is None:
        cache = DynamicCache(config=config)
    past = cache.get_seq_length()
    mask, causal = None, False
    if attention_mask is not None and not bool(attention_mask.all()):
        mask = attention_mask_4d(attention_mask, T)  # (B, 1, T, P + T)
    elif past == 0:
        causal = True  # square and unpadded: the kernel's own causal mask
    else:
        mask = attention_mask_4d(torch.ones(B, past + T, dtype=torch.long, device=input_ids.device), T)
    with torch.autocast("cpu", enabled=False):
        h = inner.embed_tokens(input_ids)  # (B, T, C), the residual stream's dtype
        cos, sin = inner.rotary_emb(h, position_ids=position_ids)  # (B, T, D)
        cos, sin = cos[:, :, None], signed_sin(sin[:, :, None])  # (B, T, 1, D): the same for every head; [-sin₁, sin₂]
        for i, w in enumerate(weights.layers):
            x = _rms_norm(h, w.norm_in, w.eps_in).to(dtype)  # (B, T, C)
            qkv = w.qkv(x)  # (B, T, H·D + 2·H_kv·D)
            qk = qkv[..., : q_width + kv_width].reshape(B, T, H + H_kv, D)
            qk = _rotate(qk, cos, sin)  # (B, T, H + H_kv, D), in cos's dtype
            query = qk[:, :, :H].transpose(1, 2)  # (B, H, T, D)
            key = qk[:, :, H:].transpose(1, 2).contiguous()  # (B, H_kv, T, D) fp32, as transformers caches it
            value = qkv[..., q_width + kv_width :].reshape(B, T, H_kv, D).transpose(1, 2).contiguous()  # (B, H_kv, T, D)
            keys, values = cache.update(key, value, i)  # (B, H_kv, P + T, D)
            attended = F.scaled_dot_product_attention(query.to(dtype), keys.to(dtype), values.to(dtype), attn_mask=mask,
                                                      is_causal=causal, scale=scaling, enable_gqa=True)  # (B, H, T, D)
            h = mlp_residual(h + w.o(attended.transpose(1, 2).reshape(B, T, q_width)), w, dtype)  # (B, T, C)
        logits = head_logits(h[:, -1], weights) if last else None  # (B, V)
    return cache, logits
