"""Advantage estimators (pure torch), each registered by name in :mod:`ragen.algos.registry`.

Every estimator has the same signature ``fn(inp: AdvantageInputs) -> AdvantageOutputs``, so the
trainer never special-cases one. Dims: B = batch (sequences), T = tokens.

Conventions shared by all estimators:
    * ``token_rewards`` (B, T) holds the reward on tokens: the trajectory reward on the last
      model-written token, or per-turn rewards on each turn's last model-written token.
    * Outcome ("score") estimators use the per-sequence score ``Σ_t token_rewards[b, t]``.
    * ``advantages`` is 0 outside ``response_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ragen.algos.core import group_stats, masked_mean
from ragen.algos.registry import register_adv_estimator


@dataclass
class AdvantageInputs:
    """Inputs of every advantage estimator (fields an estimator does not use are ignored)."""

    token_rewards: Tensor  # (B, T) float
    response_mask: Tensor  # (B, T) bool/float; 1 on model-written (loss) tokens
    group_ids: Tensor  # (B,) long; rollouts from the same seed/prompt share an id
    values: Tensor | None = None  # (B, T) critic values (gae / bi_level_gae)
    turn_ends: Tensor | None = None  # (B, T) bool; True at the last model-written token of each turn
    gamma: float = 1.0
    lam: float = 1.0
    high_level_gamma: float = 0.95
    norm_adv_by_std: bool = True  # GRPO's std normalisation (Dr.GRPO turns it off)
    eps: float = 1e-6
    # GiGPO (Feng et al. 2025) step-level inputs
    anchor_ids: Tensor | None = None  # (B, T) long; anchor-state id on each turn's tokens, -1 elsewhere
    step_returns: Tensor | None = None  # (B, T) float; discounted return from each turn, on its tokens
    gigpo_step_weight: float = 1.0  # omega in A = A_episode + omega * A_step


@dataclass
class AdvantageOutputs:
    advantages: Tensor  # (B, T), zero outside response_mask
    returns: Tensor  # (B, T)
    metrics: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def sequence_scores(token_rewards: Tensor) -> Tensor:
    """Per-sequence score: (B, T) → (B,), the sum of the token rewards over the sequence."""
    rewards = token_rewards if token_rewards.is_floating_point() else token_rewards.float()
    return rewards.sum(dim=-1)


def broadcast_to_tokens(seq_adv: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) sequence advantage → (B, T): the scalar on every masked token, 0 elsewhere."""
    mask = response_mask.bool()
    return torch.where(mask, seq_adv[:, None].expand(mask.shape), 0.0)


def group_normalized_scores(
    scores: Tensor, keys: Tensor, norm_by_std: bool, eps: float
) -> Tensor:
    """Group-relative advantage of each element: ``(s − mean_g) / (std_g + eps)`` (or ``s − mean_g``).

    Args:
        scores: (N,) float.
        keys: (N,) or (N, K) long group keys.
    Returns:
        (N,); 0 for elements whose group has size 1 (no baseline is available).
        std is unbiased (Bessel-corrected, ``torch.std``'s default), as in verl's GRPO.
    """
    mean, std, count = group_stats(scores, keys)
    centred = scores - mean
    adv = centred / (std + eps) if norm_by_std else centred
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def _metrics(scores: Tensor | None, advantages: Tensor, returns: Tensor, mask: Tensor) -> dict[str, float]:
    mask = mask.bool()
    adv_tokens = advantages[mask]
    out = {
        "adv/advantages_mean": float(masked_mean(advantages, mask)),
        "adv/advantages_max": float(adv_tokens.max()) if adv_tokens.numel() else 0.0,
        "adv/advantages_min": float(adv_tokens.min()) if adv_tokens.numel() else 0.0,
        "adv/returns_mean": float(masked_mean(returns, mask)),
    }
    if scores is not None and scores.numel():
        out["adv/score_mean"] = float(scores.mean())
        out["adv/score_std"] = float(scores.std()) if scores.numel() > 1 else 0.0
    return out


def _outcome_outputs(seq_adv: Tensor, scores: Tensor, inp: AdvantageInputs) -> AdvantageOutputs:
    """Outputs of an outcome estimator: broadcast (B,) advantage to tokens; returns = advantages."""
    advantages = broadcast_to_tokens(seq_adv, inp.response_mask)  # (B, T)
    return AdvantageOutputs(advantages, advantages.clone(), _metrics(scores, advantages, advantages, inp.response_mask))


# ---------------------------------------------------------------------------------------------
# outcome (critic-free) estimators
# ---------------------------------------------------------------------------------------------


@register_adv_estimator("grpo")
def grpo(inp: AdvantageInputs) -> AdvantageOutputs:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath §4.1.2, the Â_{i,t} of eq. 3).

    For sequence i in group g (same ``group_ids``) with score r_i = Σ_t token_rewards[i, t]:
        Â_i = (r_i − mean_g(r)) / (std_g(r) + eps)   if ``norm_adv_by_std``
        Â_i =  r_i − mean_g(r)                       otherwise (Dr.GRPO, Liu et al. 2025)
    std_g is the unbiased (correction=1) std, as ``torch.std`` and verl. A group of size 1 gets
    Â = 0. Â_i is broadcast to every masked token of sequence i.

    Shapes: token_rewards/response_mask (B, T), group_ids (B,) → advantages/returns (B, T);
    returns = advantages.
    """
    scores = sequence_scores(inp.token_rewards)  # (B,)
    seq_adv = group_normalized_scores(scores, inp.group_ids, inp.norm_adv_by_std, inp.eps)  # (B,)
    return _outcome_outputs(seq_adv, scores, inp)
