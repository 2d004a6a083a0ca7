"""A group's prompt and its rows' continuations in one decoder row, under a block mask.

Every env of a group shares its seed, so its rows start with the same prompt. The update and scoring
passes exploit that in one of two layouts (:func:`ragen.train.logprobs.decoder_hidden` picks):

``split``
    The distinct prompts run as one left-padded batch ``(G, P)``; their KV cache is copied to every
    row and the rows' continuations run as a second batch ``(B, S)`` on top of it. Two decoder passes.
``packed`` (this module)
    One decoder pass over ``G`` rows, each a prompt followed by all of its rows' continuations::

        row g = [ prompt_g | continuation_r1 | continuation_r2 | ... ]     (right-padded to T)

    with a block mask: a prompt token attends causally within the prompt; a continuation token attends
    to the whole prompt and causally to its own continuation, never to a sibling's. Positions restart
    after the prompt for every continuation, so each token sees exactly the keys and positions it has in
    its own full row, and the hidden states equal the plain pass's up to float rounding.

The packed layout runs every linear layer once per micro-batch on ``G·T`` rows instead of twice (on
``G·P`` and on ``B·S`` rows): one weight-gradient GEMM per layer instead of two thin ones, no KV copy and
no second pass of per-op overhead. Its attention is dense over the row, ``G·T²`` query-key pairs, of
which the mask discards the sibling blocks; the split layout computes ``G·P² + B·S·(P+S)``.
:func:`packed_is_cheaper` weighs both: short answers on a long shared prompt (the bandit main job:
~110-token prompts, ≤ 16-token answers, 4 rows per group) favour the packed layout; long continuations
(64-token answers × 8 rows per prompt, multi-turn episodes) the split one, whose attention is not
mostly masked-out work. Measured by ``benchmarks/bench_update.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragen.models.train_attention import NAME as GROUPED_ATTENTION

#: Attention implementations whose masks are 4-d tensors that a custom mask may replace. transformers passes an
#: already prepared 4-d mask through unchanged; flash and flex attention take no arbitrary dense mask.
DENSE_MASK_ATTENTION = ("sdpa", "eager", GROUPED_ATTENTION)

#: How many times slower than the decoder's GEMMs (per FLOP) a dense attention call runs on the CPU. Measured on
#: a 2-core Zen 5 (bf16): GEMMs at update shapes ~600-750 GFLOP/s, masked attention 150-200 GFLOP/s.
ATTENTION_SLOWDOWN = 4.0

#: What a decoder pass costs beyond its tokens, in tokens: per-op overhead and the weight-sized work of a backward
#: (weight gradients, casts) that does not shrink with the pass. SmolLM2-135M, bf16, forward + backward of
#: ``(4, n)`` batches on a 2-core Zen 5: 180 ms at 32 tokens, 509 ms at 256, 1 587 ms at 1 024, i.e. ~1.4 ms
#: per token plus ~150 ms (``/tmp/mb/passcost.py``, throwaway).
PASS_OVERHEAD_TOKENS = 100


@dataclass
class GroupPacking:
    """Where every token of a batch goes in the packed ``(G, T)`` layout."""

    input_ids: torch.Tensor  # (G, T) prompt, then each row's continuation; padded with the pad id
    position_ids: torch.Tensor  # (G, T) each token's position in its own full row
    segments: torch.Tensor  # (G, T) 0 for the prompt, 1 + k for the group's k-th continuation, -1 for padding
    gather: torch.Tensor  # (B, L) row r's position t -> index into the flattened (G·T) layout (0 past its end)


def group_widths(lengths: list[int], prompt_lengths: list[int], row_group: list[int], group_count: int) -> list[int]:
    """Tokens in each packed row: the group's prompt plus every continuation of its rows."""
    widths = [0] * group_count
    seen = [False] * group_count
    for n, p, g in zip(lengths, prompt_lengths, row_group):
        widths[g] += n - p if seen[g] else n  # the group's first row brings the prompt
        seen[g] = True
    return widths


def pack_groups(input_ids: torch.Tensor, lengths: list[int], prompt_lengths: list[int], row_group: list[int],
                group_count: int, pad_id: int) -> GroupPacking:
    """The packed layout of a right-padded ``(B, L)`` CPU batch whose row ``r`` has ``lengths[r]`` tokens, of
    which the first ``prompt_lengths[r]`` are the prompt it shares with the other rows of group ``row_group[r]``
    (every group is some row's; groups numbered ``0 .. group_count - 1``)."""
    B, L = input_ids.shape
    members: list[list[int]] = [[] for _ in range(group_count)]
    for r in range(B):
        members[row_group[r]].append(r)
    heads = [rows[0] for rows in members]  # a row holding the group's prompt
    T = max(group_widths(lengths, prompt_lengths, row_group, group_count))
    ids = torch.full((group_count, T), pad_id, dtype=input_ids.dtype)  # (G, T)
    positions = torch.zeros((group_count, T), dtype=torch.long)  # (G, T)
    segments = torch.full((group_count, T), -1, dtype=torch.long)  # (G, T)
    gather = torch.zeros((B, L), dtype=torch.long)  # (B, L)
    for g, rows in enumerate(members):
        p = prompt_lengths[heads[g]]
        ids[g, :p] = input_ids[heads[g], :p]
        positions[g, :p] = torch.arange(p)
        segments[g, :p] = 0
        start = p
        for k, r in enumerate(rows, start=1):
            s = lengths[r] - prompt_lengths[r]
            ids[g, start : start + s] = input_ids[r, p : p + s]
            positions[g, start : start + s] = torch.arange(p, p + s)
            segments[g, start : start + s] = k
            gather[r, :p] = g * T + torch.arange(p)
            gather[r, p : p + s] = g * T + torch.arange(start, start + s)
            start += s
    return GroupPacking(ids, positions, segments, gather)


def block_mask(segments: torch.Tensor, attention: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``(G, 1, T, T)`` mask of a packed batch: query ``i`` may read key ``j ≤ i`` of the prompt or of its own segment.

    Boolean (True = attend) for ``sdpa``-style implementations, additive (0 or ``dtype``'s lowest) for
    ``eager``, as transformers' own masks. Padding queries read the prompt (a row never fully masked); no
    loss reads them.
    """
    T = segments.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril_()  # (T, T)
    key_seg, query_seg = segments[:, None, :], segments[:, :, None]  # (G, 1, T), (G, T, 1)
    allowed = causal & ((key_seg == 0) | ((key_seg == query_seg) & (key_seg > 0)))  # (G, T, T)
    allowed = allowed[:, None]  # (G, 1, T, T)
    if attention == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=segments.device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return allowed


def pair_cost_in_tokens(decoder) -> float:
    """What one query-key pair of attention costs, in tokens through the decoder's weights (both per layer).

    A token costs ``2 · W`` FLOPs through a layer of ``W`` weights; a pair ``4 · H · D`` (``q·k`` and
    ``p·v`` over ``H`` query heads of width ``D``), run :data:`ATTENTION_SLOWDOWN` times less efficiently.
    """
    config = decoder.config
    layer = decoder.layers[0]
    weights = sum(p.numel() for p in layer.parameters())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 4 * heads * head_dim * ATTENTION_SLOWDOWN / (2 * weights)


def packed_is_cheaper(lengths: list[int], prompt_lengths: list[int], row_group: list[int], group_count: int,
                      pair_cost: float) -> bool:
    """Whether one packed pass costs less than the split layout's two, counting the (padded) tokens each runs
    through the weights, its attention pairs at ``pair_cost`` tokens each and :data:`PASS_OVERHEAD_TOKENS` for
    the split layout's second pass."""
    B = len(lengths)
    P, S = max(prompt_lengths), max(n - p for n, p in zip(lengths, prompt_lengths))
    split = group_count * P + B * S + pair_cost * (group_count * P * P + B * S * (P + S)) + PASS_OVERHEAD_TOKENS
    T = max(group_widths(lengths, prompt_lengths, row_group, group_count))
    packed = group_count * T + pair_cost * group_count * T * T
    return packed < split


def packing_supported(decoder, width: int) -> bool:
    """Whether a custom block mask means for this model what it means here: a dense-mask attention implementation,
    no sliding window that a row of ``width`` tokens could exceed, every layer full attention."""
    config = decoder.config
    if getattr(config, "_attn_implementation", None) not in DENSE_MASK_ATTENTION:
        return False
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return False
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and width > window:
        return False
    return hasattr(decoder, "layers") and len(decoder.layers) > 0
