"""Keep env tags apart in the update: StarPO-S filtering and advantage estimation run per tag.

Group estimators (GRPO, Dr.GRPO, RLOO, GiGPO) already normalise within groups, and group ids
are unique across tags, so they never mix tags. Batch-level estimators (BRPO, REINFORCE++,
GAE's whitening) and the StarPO-S filter would: a Sokoban return of ~10 next to a Bandit
return of ~0.25 would set the Bandit rows' baseline and scale. Running each of them on one
tag's rows at a time makes "never across tags" hold for every estimator; with one tag it is
exactly the plain call.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable, Sequence

import torch

from ragen.algos import AdvantageInputs
from ragen.algos.advantages import AdvantageOutputs
from ragen.algos.filtering import uncertainty_filter


def tag_rows(tags: Sequence[str]) -> dict[str, torch.Tensor]:
    """Row indices ``(n_tag,)`` of each tag, tags in order of first appearance."""
    rows: dict[str, list[int]] = {}
    for i, tag in enumerate(tags):
        rows.setdefault(tag, []).append(i)
    return {tag: torch.tensor(index, dtype=torch.long) for tag, index in rows.items()}


def _select(inp: AdvantageInputs, index: torch.Tensor) -> AdvantageInputs:
    """``inp`` restricted to rows ``index`` (every per-row tensor field; scalars unchanged)."""
    rows = {f.name: getattr(inp, f.name)[index] for f in fields(inp) if isinstance(getattr(inp, f.name), torch.Tensor)}
    return replace(inp, **rows)


def per_tag_advantages(
    estimator: Callable[[AdvantageInputs], AdvantageOutputs], inp: AdvantageInputs, tags: Sequence[str]
) -> AdvantageOutputs:
    """Run ``estimator`` on each tag's rows separately and put the results back in place.

    Shapes: every ``inp`` tensor has B rows, ``tags`` has B entries → advantages/returns (B, T).
    Metrics: one tag → the estimator's own; several → ``*_max`` maxed, ``*_min`` minned, the
    rest averaged with each tag's row count as weight.
    """
    rows = tag_rows(tags)
    if len(rows) == 1:
        return estimator(inp)
    advantages = torch.zeros_like(inp.token_rewards, dtype=torch.float)
    returns = torch.zeros_like(advantages)
    parts: list[tuple[int, dict[str, float]]] = []
    for index in rows.values():
        out = estimator(_select(inp, index))
        advantages[index] = out.advantages.to(advantages.dtype)
        returns[index] = out.returns.to(returns.dtype)
        parts.append((len(index), out.metrics))
    return AdvantageOutputs(advantages, returns, _combine(parts))


def _combine(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    total = sum(n for n, _ in parts)
    out: dict[str, float] = {}
    for key in {k for _, m in parts for k in m}:
        values = [(n, m[key]) for n, m in parts if key in m]
        if key.endswith("_max"):
            out[key] = max(v for _, v in values)
        elif key.endswith("_min"):
            out[key] = min(v for _, v in values)
        else:
            out[key] = sum(n * v for n, v in values) / max(1, sum(n for n, _ in values)) if total else 0.0
    return out


def per_tag_filter(
    scores: torch.Tensor, group_ids: torch.Tensor, tags: Sequence[str], keep_ratio: float, mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """StarPO-S uncertainty filter within each tag: keep ``keep_ratio`` of every tag's groups.

    Shapes: scores, group_ids (B,) → keep mask (B,) bool. One tag → exactly
    :func:`ragen.algos.filtering.uncertainty_filter`; several → ``filter/kept_ratio`` and
    ``filter/kept_groups`` over the batch, the in-group stds per tag as ``filter/<tag>/std_before|after``.
    """
    rows = tag_rows(tags)
    if len(rows) == 1:
        return uncertainty_filter(scores, group_ids, keep_ratio=keep_ratio, mode=mode)
    keep = torch.zeros(len(scores), dtype=torch.bool)
    metrics: dict[str, float] = {"filter/kept_groups": 0.0}
    for tag, index in rows.items():
        kept, m = uncertainty_filter(scores[index], group_ids[index], keep_ratio=keep_ratio, mode=mode)
        keep[index] = kept
        metrics["filter/kept_groups"] += m.get("filter/kept_groups", 0.0)
        for key in ("std_before", "std_after"):
            if f"filter/{key}" in m:
                metrics[f"filter/{tag}/{key}"] = m[f"filter/{key}"]
    metrics["filter/kept_ratio"] = float(keep.float().mean()) if len(keep) else 0.0
    return keep, metrics
