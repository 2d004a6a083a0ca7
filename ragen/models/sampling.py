"""Next-token sampling by inverse transform, run inside ``generate`` as a logits processor (or called directly by
:mod:`ragen.models.decode_loop` through :meth:`InverseCDFSampler.draw`).

``generate(do_sample=True)`` draws each token with ``torch.multinomial``, which on the CPU
builds one exponential variate per vocabulary entry: for a 49k vocabulary that is ~16 ms per
decode step at batch 16 and ~60 ms at batch 64 on a 2-core machine, 15–25 % of a decode step
of SmolLM2-135M. Inverse-transform sampling needs one uniform per row:

    x ~ p  ⇔  x = min { i : F(i) ≥ u · F(V-1) },  F(i) = Σ_{j ≤ i} w_j,  u ~ U(0, 1]

for the weights ``w = softmax(z / T)`` (any positive multiple would do). :func:`inverse_cdf` finds ``x`` in two
levels so that no ``(B, V)`` float64 tensor is built: first the block of 256 tokens, with
probability ∝ the block's mass (a cumulative sum over ~V/256 block sums), then the token
inside it, with the residual ``r = (u·F - F(block start)) / mass(block) ∈ (0, 1]`` -- given the
block, ``r`` is uniform, so ``P(x) = mass(block)/F · w_x/mass(block) = w_x / F``.

:class:`InverseCDFSampler` applies transformers' own top-k / top-p warpers when asked (the order
``generate`` uses: temperature, top-k, top-p), draws the token, and returns scores that are 0
at it and -inf elsewhere, so ``generate``'s greedy step (``do_sample=False``) takes exactly the
sampled token; everything else ``generate`` does (its own processors before this one, stop strings,
padding finished rows) is unchanged. Given ``suppress`` (the EOS ids) and ``min_new_tokens``, it also
keeps those tokens out until that many tokens are written, as transformers' ``min_new_tokens``
processor does, but in place (that processor's ``clone`` and ``where`` build fresh ``(B, V)`` tensors at
every step: ~17 % of a ``generate`` call of 32 rows, ``docs/performance.md``). The distribution is the one
``do_sample=True`` samples from; only the random stream differs.

Every decode step of a ``generate`` call reuses one ``(B, V)`` float32 buffer for the weights
and the returned scores (transformers' top-k / top-p warpers, when asked for, still allocate their own): on a 2-core EPYC a fresh ``(32, 49 152)`` tensor per step meant fresh
pages (page faults) each time (``benchmarks/bench_decode.py``). The
returned tensor is therefore overwritten at the next step: do not combine this processor with
``generate(output_scores=True)``, which keeps every step's scores, nor with ``output_logits=True`` (the raw
logits it keeps can be the very tensor this processor writes in place).

Which distribution, on every path. ragen's own ``temperature`` / ``top_k`` / ``top_p`` (``SamplingParams``, from
``rollout.*``) decide the warping, whichever sampler runs: they already override the model's ``generation_config``
values of the same names, and the model's other warpers (min-p, typical-p, epsilon, eta, top-h) and its watermark
are switched off for ``generate(do_sample=True)`` too (:func:`multinomial_generate_kwargs`), as on the vLLM engine,
which is sent ragen's three values alone. Without that, a model whose ``generation_config`` sets e.g. ``min_p``
sampled a truncated distribution with ``sampler="multinomial"`` and the full one here. The trainer's log-probs
(``ragen/train/logprobs.py``: ``log softmax(z / rollout.temperature)``) are those of this distribution when top-k
and top-p are off (the defaults); with them on, tokens come from the renormalised head, which the old log-probs
and the importance ratio do not model. Processors that are not warpers (a repetition penalty in the model's
``generation_config``, ...) run on both HF paths alike -- ``generate`` applies them before this processor, the
decode loop hands such models to ``generate`` -- and are not in the trainer's log-probs either.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper, TemperatureLogitsWarper

#: Tokens per block of :func:`inverse_cdf`'s first level.
BLOCK = 256

#: ``generation_config`` fields with which ``generate(do_sample=True)`` warps the sampled distribution beyond
#: temperature / top-k / top-p (transformers 5's ``_get_logits_processor``: the min-p, typical, epsilon, eta and
#: top-h warpers, and the watermark it adds after them), each with the value that adds nothing.
#: :class:`InverseCDFSampler` applies none of them -- a watermark could not even be honoured, as ``generate`` runs it
#: after this processor has chosen the token -- so the multinomial path is asked not to either.
GENERATION_CONFIG_WARPERS_OFF = {"min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                                 "top_h": None, "watermarking_config": None}


def multinomial_generate_kwargs(generation_config, temperature: float = 1.0, top_k: int = 0,
                                top_p: float = 1.0) -> dict:
    """``generate`` keyword arguments that sample with ``torch.multinomial`` from :class:`InverseCDFSampler`'s distribution.

    ``generate`` merges the model's ``generation_config`` (and transformers' global defaults, among them ``top_k=50``)
    into every call; explicit arguments win. So ragen's three values are always passed (``top_k=None``, not 0, keeps
    the default 50 out), and the other warpers are passed switched off (:data:`GENERATION_CONFIG_WARPERS_OFF`): the
    distribution is the one ``SamplingParams`` describes and the trainer scores, whatever the model's config says.
    """
    # only fields this transformers knows (top_h is newer than 5.0): generate hands unknown ones to the model
    off = {name: value for name, value in GENERATION_CONFIG_WARPERS_OFF.items() if hasattr(generation_config, name)}
    return dict(do_sample=True, temperature=temperature, top_k=top_k or None, top_p=top_p, **off)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``min { i : Σ_{j ≤ i} w_j ≥ u · Σ_j w_j }`` per row, in two levels; returns ``(B, 1)`` int64.

    ``weights`` is ``(B, V)``, non-negative, at least one positive entry per row; ``u`` is
    ``(B, 1)`` float64 in ``(0, 1]``. A zero-weight token is never returned; a row whose weights are
    not finite or sum to zero raises ``ValueError``. Block sums are float32
    sums of float32 weights (relative rounding ~1e-7, that of the weights themselves); the
    cumulative sums are float64.
    """
    B, V = weights.shape
    full = V - V % block
    sums = weights[:, :full].reshape(B, full // block, block).sum(-1)  # (B, V // block), a view: no copy
    if full < V:
        sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True)], dim=-1)  # (B, nb) the tail block
    mass = sums.double()  # (B, nb)
    cum = mass.cumsum(-1)  # (B, nb) F at each block's end
    total = cum[:, -1]  # (B,)
    if not (torch.isfinite(total) & (total > 0)).all():  # as torch.multinomial refuses such rows
        raise ValueError("inverse_cdf: a row's weights are not finite or sum to zero (NaN, inf or all -inf logits)")
    target = u * cum[:, -1:]  # (B, 1) in (0, F(V-1)]
    blk = torch.searchsorted(cum, target).clamp_(max=cum.shape[1] - 1)  # (B, 1) first block with F ≥ target
    start = torch.where(blk > 0, cum.gather(1, (blk - 1).clamp(min=0)), torch.zeros_like(target))  # (B, 1)
    # r ∈ (0, 1]: F(start) < target ≤ F(end) by the search (a chosen block has positive mass)
    r = ((target - start) / mass.gather(1, blk)).clamp_(max=1.0)  # (B, 1)
    cols = blk * block + torch.arange(block, device=weights.device)  # (B, block) the block's token ids
    inside = weights.gather(1, cols.clamp(max=V - 1)).double() * (cols < V)  # (B, block) past V: weight 0
    within = inside.cumsum_(-1)  # (B, block)
    j = torch.searchsorted(within, r * within[:, -1:])  # (B, 1) never past the block's last positive weight
    return (blk * block + j).clamp_(max=V - 1)  # (B, 1); the clamp only guards float edge cases


class InverseCDFSampler(LogitsProcessor):
    """Samples one token per row from softmax(warped scores); returns 0 at it, -inf elsewhere."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
                 suppress: list[int] | tuple[int, ...] = (), min_new_tokens: int = 0):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        #: Token ids (EOS) that cannot be drawn until ``min_new_tokens`` tokens have been written.
        self.suppress = list(suppress)
        self.min_new_tokens = int(min_new_tokens)
        self._prompt_width: int | None = None
        warpers = []
        if top_k or top_p < 1.0:  # these need the tempered scores; otherwise T is applied inside the exp below
            if temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(temperature))
            if top_k:
                warpers.append(TopKLogitsWarper(top_k))
            if top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p))
        self.warpers = LogitsProcessorList(warpers)  # empty: T is applied inside the exp
        self.generator = generator
        self._buffer: torch.Tensor | None = None
        #: Per drawn step, ``(B,)`` fp32: log of the drawn token's probability under the distribution it was drawn
        #: from (softmax of the warped scores; with top-k and top-p off, ``log softmax(z / T)`` at the token).
        self.drawn_logprobs: list[torch.Tensor] = []

    def _weights_buffer(self, scores: torch.Tensor) -> torch.Tensor:
        if self._buffer is None or self._buffer.shape != scores.shape or self._buffer.device != scores.device:
            self._buffer = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
        return self._buffer

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        token = self.draw(input_ids, scores)  # (B, 1)
        return self._buffer.fill_(float("-inf")).scatter_(1, token, 0.0)

    def draw(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.LongTensor:
        """The sampled token per row, ``(B, 1)``, for ``input_ids`` ``(B, L)`` so far and fp32 ``scores`` ``(B, V)``.

        ``scores`` is written (EOS set to -inf before ``min_new_tokens``; divided by the temperature when no
        warper applies it), so each step's scores can be drawn from once. :mod:`ragen.models.decode_loop` calls this
        directly; ``generate`` goes through ``__call__``.
        """
        weights = self._weights(input_ids, scores)  # (B, V)
        u = 1.0 - torch.rand((scores.shape[0], 1), dtype=torch.float64, device=scores.device, generator=self.generator)
        token = inverse_cdf(weights, u)  # (B, 1)
        self.drawn_logprobs.append(weights.gather(1, token).squeeze(1).log())  # (B,)
        return token

    def probs(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        """The distribution :meth:`draw` samples from for these arguments, ``(B, V)`` float64 (a fresh tensor).

        Computed by the same code as ``draw``'s weights, so a comparison with another sampling path (tests,
        diagnostics) checks what is really drawn; ``scores`` may be written, as by ``draw``.
        """
        weights = self._weights(input_ids, scores).double()  # (B, V) a copy: the buffer is reused
        return weights / weights.sum(-1, keepdim=True)

    def _weights(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        """softmax of the warped scores, ``(B, V)`` float32 in the reused buffer (see :meth:`draw`)."""
        if self._prompt_width is None or input_ids.shape[1] < self._prompt_width:  # a generate call's first step
            self._prompt_width = input_ids.shape[1]  # (one sampler per call, as HFBackend makes them)
        if self.suppress and input_ids.shape[1] - self._prompt_width < self.min_new_tokens:
            # as transformers' MinNewTokensLengthLogitsProcessor (-inf before the warpers), but in place:
            # ``scores`` is this step's own fp32 copy of the logits (generate's, or the decode loop's buffer)
            scores[:, self.suppress] = float("-inf")
        scores = self.warpers(input_ids, scores)  # (B, V)
        weights = self._weights_buffer(scores)  # (B, V) float32, reused every step
        if not self.warpers and self.temperature != 1.0:
            scores.div_(self.temperature)  # z / T, in this step's own fp32 copy (with warpers, they applied T)
        # softmax(z / T) as one op, written into the kept buffer (-inf gives weight 0). Was exp((z - max z) / T) in three
        # ops (amax, sub, exp_): the same distribution up to fp32 rounding, and ~0.6 ms less a step at (32, 49 152) on a
        # 2-core Zen 5, where torch's fp32 exp_ goes to MKL's slow path on AMD (benchmarks/bench_decode.py)
        return torch.ops.aten._softmax.out(scores, -1, False, out=weights)  # (B, V), rows sum to 1
