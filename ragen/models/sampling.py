"""Next-token sampling by inverse transform, run inside ``generate`` as a logits processor.

``generate(do_sample=True)`` draws each token with ``torch.multinomial``, which on the CPU
builds one exponential variate per vocabulary entry: for a 49k vocabulary that is ~16 ms per
decode step at batch 16 and ~60 ms at batch 64 on a 2-core machine, 15–25 % of a decode step
of SmolLM2-135M. Inverse-transform sampling needs one uniform per row:

    x ~ p  ⇔  x = min { i : F(i) ≥ u },  F(i) = Σ_{j ≤ i} p_j,  u ~ U(0, 1]

(a cumulative sum and a binary search, ~0.4 ms at batch 16). :class:`InverseCDFSampler`
applies transformers' own temperature / top-k / top-p warpers (the order ``generate`` uses),
draws the token, and returns scores that are 0 at it and -inf elsewhere, so ``generate``'s
greedy step (``do_sample=False``) takes exactly the sampled token; everything else
``generate`` does (EOS and ``min_new_tokens`` processors before this one, stop strings,
padding finished rows) is unchanged. The distribution is the one ``do_sample=True`` samples
from; only the random stream differs.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


class InverseCDFSampler(LogitsProcessor):
    """Samples one token per row from softmax(warped scores); returns 0 at it, -inf elsewhere."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        warpers = []
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        self.warpers = LogitsProcessorList(warpers)
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = self.warpers(input_ids, scores)  # (B, V)
        cdf = torch.softmax(scores.float(), dim=-1).double().cumsum_(-1)  # (B, V) F(i); float64 so F(V-1) ≈ 1 exactly
        # u ∈ (0, F(V-1)]: u > 0 never selects a leading zero-probability token, u ≤ F(V-1) always finds one.
        u = (1.0 - torch.rand((scores.shape[0], 1), dtype=torch.float64, device=scores.device, generator=self.generator))
        token = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=scores.shape[-1] - 1)  # (B, 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)
