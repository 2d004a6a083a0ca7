"""Policy / entropy / value / KL losses (pure torch). Dims: B = batch (sequences), T = tokens.

Policy losses are registered by name (:func:`ragen.algos.registry.register_policy_loss`) and share
the signature ``fn(logprobs, old_logprobs, advantages, mask, *, clip_ratio_low, clip_ratio_high,
clip_ratio_c, loss_agg_mode) -> (scalar loss, metrics)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ragen.algos.core import aggregate_loss, masked_mean
from ragen.algos.registry import register_policy_loss

# log-ratios are clamped before exp() so a stale/broken token cannot overflow the ratio (as verl).
LOG_RATIO_CLAMP = 20.0


def importance_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """Per-token ratio π_θ/π_old = exp(logprobs − old_logprobs), log-ratio clamped to ±20. (B, T)."""
    return torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _frac(condition: Tensor, mask: Tensor) -> float:
    """Fraction of masked tokens where ``condition`` (B, T) holds."""
    return float(masked_mean(condition.float(), mask))


@register_policy_loss("clipped")
def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric clipping
    ("clip-higher", DAPO, Yu et al. 2025 §3.1) and optional dual clip (Ye et al. 2020, dual-clip PPO).

    Per token, with r = exp(logprobs − old_logprobs) and A = advantages:
        l = max(−A·r, −A·clip(r, 1 − clip_ratio_low, 1 + clip_ratio_high))
        if clip_ratio_c is set (> 1) and A < 0:  l = min(l, −A·clip_ratio_c)
    then aggregated over ``mask`` with :func:`ragen.algos.core.aggregate_loss` (``loss_agg_mode``).

    Args:
        logprobs: (B, T) log π_θ of the taken tokens (requires grad).
        old_logprobs: (B, T) log π_old (behaviour policy), no grad.
        advantages: (B, T).
        mask: (B, T) bool/float, 1 on loss tokens.
    Returns:
        ``(loss, metrics)``: scalar loss; metrics ``actor/pg_loss``, ``actor/clipfrac_low`` /
        ``actor/clipfrac_high`` (fraction of masked tokens whose lower / upper clip is active, i.e.
        the clipped branch is selected and the gradient is zero), ``actor/clipfrac_dual``,
        ``actor/approx_kl`` (masked mean of old_logprobs − logprobs, the k1 estimator) and
        ``actor/ratio_mean``.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {clip_ratio_c}")
    ratio = importance_ratio(logprobs, old_logprobs)  # (B, T)
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # (B, T)
    per_token = torch.maximum(unclipped, clipped)  # (B, T)
    dual_active = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c  # (B, T)
        dual_active = (advantages < 0) & (per_token > dual_bound)
        per_token = torch.where(dual_active, dual_bound, per_token)
    loss = aggregate_loss(per_token, mask, loss_agg_mode)

    with torch.no_grad():
        metrics = {
            "actor/pg_loss": float(loss.detach()),
            "actor/clipfrac_low": _frac((advantages < 0) & (ratio < 1.0 - clip_ratio_low), mask),
            "actor/clipfrac_high": _frac((advantages > 0) & (ratio > 1.0 + clip_ratio_high), mask),
            "actor/clipfrac_dual": _frac(dual_active, mask),
            "actor/approx_kl": float(masked_mean(old_logprobs - logprobs, mask)),
            "actor/ratio_mean": float(masked_mean(ratio, mask)),
        }
    return loss, metrics


def entropy_loss(entropy: Tensor, mask: Tensor, loss_agg_mode: str = "token-mean") -> Tensor:
    """Aggregated policy entropy (scalar) over ``mask`` with ``loss_agg_mode``.

    ``entropy`` is the per-token entropy (B, T) of π_θ; the trainer *subtracts* ``coef · entropy``
    from the loss (entropy bonus, Schulman et al. 2017 eq. 9 / Mnih et al. 2016).
    """
    return aggregate_loss(entropy, mask, loss_agg_mode)


# ---------------------------------------------------------------------------------------------
# KL penalty estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html)
# ---------------------------------------------------------------------------------------------


def _kl_k1(log_ratio: Tensor) -> Tensor:
    return log_ratio  # log π/π_ref: unbiased, high variance, can be negative


def _kl_k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()  # ½ (log π/π_ref)²: biased, low variance, ≥ 0


def _kl_k3(log_ratio: Tensor) -> Tensor:
    return torch.expm1(-log_ratio) + log_ratio  # π_ref/π − 1 − log(π_ref/π): unbiased, ≥ 0


KL_ESTIMATORS = {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman 2020's k1/k2/k3).

    With x = logprobs − ref_logprobs (B, T):
        k1 = x,   k2 = ½·x²,   k3 = exp(−x) − 1 + x   (GRPO's KL term, Shao et al. 2024 eq. 4)
    Returns (B, T); aggregate with :func:`ragen.algos.core.aggregate_loss`. ValueError on an
    unknown ``kind``.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logprobs - ref_logprobs)


# ---------------------------------------------------------------------------------------------
# critic
# ---------------------------------------------------------------------------------------------


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range_value: float | None = None,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, float]]:
    """PPO critic loss with value clipping (OpenAI baselines ppo2; Engstrom et al. 2020,
    "Implementation Matters in Deep Policy Gradients", §3 "value function clipping").

    Per token (all (B, T)):
        V_clip = old_values + clip(values − old_values, −c, c)
        l = ½·max((values − returns)², (V_clip − returns)²)          (c = ``clip_range_value``)
    and l = ½·(values − returns)² when ``clip_range_value`` is None; aggregated over ``mask`` with
    ``loss_agg_mode``. Returns ``(loss, metrics)`` with ``critic/vf_loss``, ``critic/vf_clipfrac``
    (fraction of masked tokens where the clipped term is selected) and ``critic/vpred_mean``.
    """
    unclipped = (values - returns).square()  # (B, T)
    per_token = unclipped
    clipped_active = torch.zeros_like(unclipped, dtype=torch.bool)
    if clip_range_value is not None:
        v_clip = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)  # (B, T)
        clipped = (v_clip - returns).square()
        clipped_active = clipped > unclipped
        per_token = torch.maximum(unclipped, clipped)
    loss = 0.5 * aggregate_loss(per_token, mask, loss_agg_mode)
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": float(loss.detach()),
            "critic/vf_clipfrac": _frac(clipped_active, mask),
            "critic/vpred_mean": float(masked_mean(values, mask)),
        }
    return loss, metrics
