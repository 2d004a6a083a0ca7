"""Masked reductions, grouped statistics and loss aggregation (pure torch).

Dims: B = batch (sequences), T = tokens. A *mask* is (B, T) bool or float with 1 on loss tokens
(model-written tokens); positions outside the mask never influence a result, even if they hold
NaN/inf (reductions use ``torch.where``, not multiplication).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "group_stats",
    "aggregate_loss",
    "LOSS_AGG_MODES",
]


def _zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask`` is set, 0 elsewhere (NaN-safe, unlike ``x * mask``)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is set.

    Args:
        x: (B, T) (any shape broadcastable with ``mask``).
        mask: same shape, bool or 0/1 float.
        dim: reduce over this dim (e.g. -1 → (B,)); ``None`` → scalar over everything.
    """
    x = _zero_outside(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def widened(x: Tensor) -> Tensor:
    """``x`` in fp64 for a normalisation's sums (floating ``x`` not on MPS, which has no fp64; else ``x`` itself).

    A sum of n fp32 values in fp64 is exact for any n and reward range a run sees, so n equal values get exactly
    their value as mean (the exact sum divided by n rounds to it) and exactly 0 as deviation. In fp32 the mean of
    eight 9.9s is 1 ulp off, and ``(s − mean) / (std + eps)`` turned that ~1e-6 into an advantage of −0.47 for
    every member of a group whose episodes all scored alike (GRPO's advantage there is 0); sums in another order
    (the same return from turn rewards in other turns) differed the same way.
    """
    return x.double() if x.is_floating_point() and x.device.type != "mps" else x


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is set; 0 where nothing is masked in.

    Shapes as in :func:`masked_sum` ((B, T) → scalar, or (B,) with ``dim=-1``).
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance (scalar) of ``x`` over all masked positions; Bessel-corrected when ``unbiased``
    (matches ``torch.var``'s default and verl's ``masked_var``). 0 when fewer than 2 positions."""
    count = masked_sum(torch.ones_like(x), mask)
    centred = x - masked_mean(x, mask)
    denom = (count - 1) if unbiased else count
    return masked_sum(centred.square(), mask) / denom.clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6, shift_mean: bool = True) -> Tensor:
    """Batch whitening over masked tokens: ``(x − mean) / (std + eps)``, 0 outside the mask.

    ``mean``/``std`` are over all masked positions of the (B, T) tensor; ``std`` is unbiased.
    With ``shift_mean=False`` the mean is added back (scale-only normalisation). Computed in fp64
    (:func:`widened`), returned in ``x``'s dtype.
    """
    wide = widened(x)  # equal values whiten to exactly 0 (see widened)
    mean = masked_mean(wide, mask)
    std = masked_var(wide, mask).sqrt()
    out = (wide - mean) / (std + eps)
    if not shift_mean:
        out = out + mean
    return _zero_outside(out, mask).to(x.dtype)


def group_stats(x: Tensor, keys: Tensor, unbiased: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group mean, std and size of ``x``, gathered back to every element.

    Args:
        x: (N,) float values.
        keys: (N,) or (N, K) integer group keys; rows with equal keys form one group.
        unbiased: Bessel-corrected std (``torch.std`` default, as verl's GRPO). A group of size 1
            gets std 0.
    Returns:
        ``(mean, std, count)``, each (N,) in ``x``'s dtype: the statistics of the group of each element,
        computed in fp64 (:func:`widened`).
    """
    if x.numel() == 0:
        return x.clone(), x.clone(), x.clone()
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)  # (N,) group index
    num_groups = int(inverse.max()) + 1
    wide = widened(x)  # a group of equal values gets exactly its value as mean and 0 as std (see widened)
    zeros = torch.zeros(num_groups, dtype=wide.dtype, device=x.device)
    count = zeros.index_add(0, inverse, torch.ones_like(wide))  # (G,)
    mean = zeros.index_add(0, inverse, wide) / count  # (G,)
    sq_dev = (wide - mean[inverse]).square()  # (N,)
    denom = (count - 1).clamp(min=1) if unbiased else count
    std = (zeros.index_add(0, inverse, sq_dev) / denom).sqrt()  # (G,)
    return tuple(t[inverse].to(x.dtype) for t in (mean, std, count))


# ---------------------------------------------------------------------------------------------
# Loss aggregation (verl's ``agg_loss``; token-mean is DAPO's token-level loss, Yu et al. 2025 §3.3)
# ---------------------------------------------------------------------------------------------


def _token_mean(loss_mat: Tensor, mask: Tensor) -> Tensor:
    # Σ_{b,t} m·l / Σ_{b,t} m  — every token weighs the same (DAPO token-level loss)
    return masked_mean(loss_mat, mask)


def _mean_over_nonempty_sequences(seq_values: Tensor, mask: Tensor) -> Tensor:
    # seq_values: (B,); sequences with no loss tokens are excluded from the mean
    nonempty = mask.bool().any(dim=-1)  # (B,)
    return masked_mean(seq_values, nonempty)


def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor) -> Tensor:
    # mean_b [ Σ_t m·l / Σ_t m ] — every sequence weighs the same (GRPO's 1/|o_i| normalisation)
    return _mean_over_nonempty_sequences(masked_mean(loss_mat, mask, dim=-1), mask)


def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor) -> Tensor:
    # mean_b [ Σ_t m·l ] — no per-sequence length normalisation (Dr.GRPO, Liu et al. 2025)
    return _mean_over_nonempty_sequences(masked_sum(loss_mat, mask, dim=-1), mask)


LOSS_AGG_MODES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
}


def aggregate_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean") -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    Modes:
        * ``"token-mean"``: Σ masked losses / number of masked tokens (DAPO token-level loss,
          Yu et al. 2025 §3.3).
        * ``"seq-mean-token-mean"``: mean over sequences of each sequence's token mean
          (GRPO, Shao et al. 2024 eq. 3's 1/|o_i| Σ_t).
        * ``"seq-mean-token-sum"``: mean over sequences of each sequence's token sum (Dr.GRPO,
          Liu et al. 2025: removes the length normalisation 1/|o_i|).

    In both ``seq-mean-*`` modes sequences with no masked tokens are excluded from the mean
    (they are not samples, e.g. padding rows or filtered groups). Returns 0 if nothing is masked.
    Raises ValueError on an unknown mode.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(LOSS_AGG_MODES)}")
    return LOSS_AGG_MODES[mode](loss_mat, mask)
