"""StarPO-S uncertainty-based rollout filtering (Wang et al. 2025, RAGEN, arXiv:2504.20073, §4
"StarPO-S": keep the prompts whose rollouts have the highest reward std). Pure torch.

Dims: B = batch (sequences), G = number of groups (distinct ``group_ids``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ragen.algos.core import group_stats

# tolerance for float ratios such as 0.29 · 100 = 28.999999999999996
_RATIO_TOL = 1e-9
# A cumulative std share within this of ``keep_ratio`` has reached it: rewards such as 0.1 and 0.3 are not exact in
# binary, so a share that is exactly the ratio in real arithmetic lands a few ulps (in fp32 ~1e-7) to either side.
_SHARE_TOL = 1e-6


def _keep_top_k(sorted_std: Tensor, keep_ratio: float) -> int:
    """Number of groups kept: ⌊keep_ratio · G⌋, at least 1."""
    return max(1, int(keep_ratio * len(sorted_std) + _RATIO_TOL))


def _keep_top_p(sorted_std: Tensor, keep_ratio: float) -> int:
    """Nucleus over the std mass: the fewest highest-std groups whose share of Σ std reaches
    ``keep_ratio`` (uniform shares if every group has std 0), at least 1."""
    sorted_std = sorted_std.double()  # in fp32, k of G equal shares summed below k/G - 1e-9 (kept one group too many)
    total = sorted_std.sum()
    share = sorted_std / total if total > 0 else torch.full_like(sorted_std, 1.0 / len(sorted_std))
    below = (share.cumsum(0) < keep_ratio - _SHARE_TOL).sum()
    return min(len(sorted_std), int(below) + 1)


#: RAGEN's slack on the std target of its ``top_p`` rule (its ``selection_eps``).
RAGEN_SELECTION_EPS = 0.01


def _keep_top_p_ragen(sorted_std: Tensor, keep_ratio: float) -> int:
    """RAGEN's nucleus rule (its ``rollout_filter`` in "linear" mode): add the highest-std groups while their summed
    std is below ``keep_ratio · Σ std − 0.01``, never a zero-std group. So, unlike :func:`_keep_top_p`, it keeps no
    group when every std is 0 (or their sum is at most ``0.01 / keep_ratio``), and otherwise may stop at the last
    positive-std group short of the target."""
    sorted_std = sorted_std.double()
    target = keep_ratio * float(sorted_std.sum()) - RAGEN_SELECTION_EPS
    kept, mass = 0, 0.0
    for std in sorted_std.tolist():
        if mass >= target or std <= 0:
            break
        mass += std
        kept += 1
    return kept if mass >= target else 0


FILTER_MODES: dict[str, Callable[[Tensor, float], int]] = {
    "top_k": _keep_top_k, "top_p": _keep_top_p, "top_p_ragen": _keep_top_p_ragen,
}


def group_reward_std(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """In-group std of the scores (unbiased; 0 for a group of size 1).

    Args:
        scores: (B,) float; group_ids: (B,) long.
    Returns:
        ``(std_per_group (G,), group_index (B,))`` float64, with groups in ascending id order: the stds are ranked
        and summed into shares, so they are kept in fp64 whatever the scores' dtype.
    """
    _, group_index = torch.unique(group_ids, return_inverse=True)  # (B,)
    num_groups = int(group_index.max()) + 1
    _, std, _ = group_stats(scores.double(), group_ids)  # (B,) fp64
    return std.new_zeros(num_groups).scatter(0, group_index, std), group_index


def uncertainty_filter(
    scores: Tensor, group_ids: Tensor, keep_ratio: float = 0.25, mode: str = "top_p"
) -> tuple[Tensor, dict[str, float]]:
    """Keep whole groups (rollouts of one prompt/seed) with the highest in-group reward std.

    StarPO-S (Wang et al. 2025, RAGEN): a prompt whose rollouts all score alike carries little
    learning signal, so only the most *uncertain* groups are trained on. Groups are ranked by the
    unbiased std of their sequence scores (ties: lower group id first), then
        * ``"top_k"``: the ⌊keep_ratio · G⌋ highest-std groups (at least 1);
        * ``"top_p"``: the fewest highest-std groups whose share of the total std reaches
          ``keep_ratio`` (zero-std groups are dropped unless needed; uniform if all stds are 0). The stds
          and their shares are computed in fp64, and a share within 1e-6 of ``keep_ratio`` reaches it.
        * ``"top_p_ragen"``: RAGEN's rule (:func:`_keep_top_p_ragen`): possibly no group at all.
    ``keep_ratio >= 1`` keeps everything in both modes.

    Args:
        scores: (B,) per-sequence scores; group_ids: (B,) long.
    Returns:
        ``(keep_mask (B,) bool, metrics)`` with ``filter/kept_ratio`` (fraction of sequences kept),
        ``filter/kept_groups``, ``filter/std_before`` / ``filter/std_after`` (mean in-group std over
        all / kept groups).
    """
    if mode not in FILTER_MODES:
        raise ValueError(f"unknown filter mode {mode!r}; known: {', '.join(FILTER_MODES)}")
    if not keep_ratio > 0:
        raise ValueError(f"keep_ratio must be > 0, got {keep_ratio}")
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=scores.device), {"filter/kept_ratio": 0.0}
    group_std, group_index = group_reward_std(scores, group_ids)  # (G,), (B,)
    order = torch.sort(group_std, descending=True, stable=True).indices  # (G,)
    n_keep = len(order) if keep_ratio >= 1 else FILTER_MODES[mode](group_std[order], keep_ratio)
    kept_groups = torch.zeros_like(group_std, dtype=torch.bool)
    kept_groups[order[:n_keep]] = True
    keep_mask = kept_groups[group_index]  # (B,)
    metrics = {
        "filter/kept_ratio": float(keep_mask.float().mean()),
        "filter/kept_groups": float(n_keep),
        "filter/std_before": float(group_std.mean()),
        "filter/std_after": float(group_std[kept_groups].mean()) if n_keep else 0.0,
    }
    return keep_mask, metrics
