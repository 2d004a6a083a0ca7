"""What an update works from once the advantages are fixed: the per-token targets of a batch, the row order that
keeps each group in one micro-batch, and the sums from which the critic's explained variance is exact."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class UpdateTargets:
    """Per-token targets fixed before the update (all ``(B, T)``; optional ones may be None)."""

    advantages: torch.Tensor
    returns: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    def select(self, index, width: int | None = None) -> "UpdateTargets":
        cut = slice(None) if width is None else slice(0, width)
        return UpdateTargets(**{k: None if v is None else v[index][:, cut] for k, v in self.__dict__.items()})

    def to(self, device: torch.device) -> "UpdateTargets":
        return UpdateTargets(**{k: None if v is None else v.to(device) for k, v in self.__dict__.items()})


def group_contiguous(index: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``index`` (a mini-batch's rows, shuffled) reordered so each group's rows are adjacent.

    Micro-batches are contiguous slices of the mini-batch, and the shared-prompt forward runs
    each distinct prompt once *per micro-batch*: a group split across micro-batches runs its
    prompt once in each. With ``lengths`` (each row's tokens, ``(B,)``) groups are ordered by
    their longest row, so a micro-batch holds groups of similar length and is padded less (each
    micro-batch is trimmed to its longest row). Which rows form the mini-batch is unchanged, and
    the optimizer step sums the micro-batches' gradients, so the order changes nothing but float
    summation order. Otherwise, and among groups of equal length, groups keep the order of their
    first row in ``index`` (the shuffle still decides it).
    """
    groups = group_ids[index].tolist()  # (M,)
    first_seen: dict[int, int] = {}
    longest: dict[int, int] = {}
    row_lengths = lengths[index].tolist() if lengths is not None else [0] * len(groups)
    for position, (g, n) in enumerate(zip(groups, row_lengths)):
        first_seen.setdefault(g, position)
        longest[g] = max(longest.get(g, 0), n)
    rank = sorted(range(len(groups)), key=lambda r: (-longest[groups[r]], first_seen[groups[r]]))
    return index[torch.tensor(rank, dtype=torch.long)]


#: Update metrics that are losses: weighted by the loss's share of a mini-batch (tokens or sequences, as
#: ``loss_agg_mode``). Other metrics are token statistics (clip fractions, ratios, KL estimates), weighted by
#: token share; either way the accumulated value is the one-pass value (tests/train/test_micro_batches.py).
LOSS_METRICS = frozenset({"actor/loss", "actor/entropy"})


#: Metric keys of :class:`ExplainedVarianceSums`' totals (summed over micro-batches, ranks and optimizer steps; not logged).
EV_PREFIX = "critic/_ev_"


class ExplainedVarianceSums:
    """Sums from which the explained variance 1 − Var[R − V] / Var[R] over all masked tokens (1 = perfect critic)
    is exact, whatever the micro-batches
    and ranks they came from (fp64: n, ΣR, ΣR², ΣD, ΣD², ΣV² with D = R − V); summed like other metrics.

    Undefined (NaN) when the returns are constant up to the fp32 rounding they were computed with: GAE's returns are
    ``A + V`` in fp32, so equal true returns (every reward 0, say) still vary by ~1e-7·|V|, and dividing by that
    variance would log a number like -1e14. Returns whose variance is below (1e-6)² times the larger of their and the
    values' mean square count as constant."""

    KEYS = ("n", "r", "r2", "d", "d2", "v2")

    def __init__(self):
        self.totals = dict.fromkeys(self.KEYS, 0.0)

    def add(self, returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
        m = mask.bool()
        r = returns[m].double()
        v = values[m].double()
        d = r - v
        for key, x in (("n", torch.ones_like(r)), ("r", r), ("r2", r * r), ("d", d), ("d2", d * d), ("v2", v * v)):
            self.totals[key] += float(x.sum())

    def as_metrics(self) -> dict[str, float]:
        return {f"{EV_PREFIX}{k}": v for k, v in self.totals.items()} if self.totals["n"] else {}

    @staticmethod
    def from_metrics(metrics: dict[str, float]) -> float:
        """The explained variance from summed :meth:`as_metrics` entries (popped from ``metrics``); NaN if undefined."""
        t = {k: metrics.pop(f"{EV_PREFIX}{k}", 0.0) for k in ExplainedVarianceSums.KEYS}
        n = t["n"]
        if n < 2:
            return float("nan")
        var_r = t["r2"] / n - (t["r"] / n) ** 2
        var_d = t["d2"] / n - (t["d"] / n) ** 2
        if var_r <= 1e-12 * max(t["r2"] / n, t["v2"] / n, 1e-300):  # constant up to fp32 rounding: undefined
            return float("nan")
        return 1.0 - var_d / var_r
