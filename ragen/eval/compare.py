"""``ragen eval A ENV --compare B``: two models on the same held-out seeds, their difference with a paired interval.

Both play the same greedy episodes (the validation seeds of each tag), so each seed gives a pair of outcomes. The
difference of the two success rates then comes with a 95 % interval from the per-seed differences
(:func:`ragen.eval.intervals.paired_difference`): a seed both solve or both fail adds no noise, which is what lets
a checkpoint comparison on 128 seeds tell a gain of a few points from chance, where two independent Wilson intervals
would overlap.
"""

from __future__ import annotations

from typing import Any

from ragen.eval.intervals import paired_difference


def _by_tag(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return report["tags"] if "tags" in report else {report.get("tag", report["env"]): report}


def compare_reports(base: dict[str, Any], other: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per tag: the paired seeds' success rates of ``base`` and ``other``, ``other`` − ``base`` with its 95 % interval,
    and how many seeds each alone solved. Seeds where either model's env raised are left out."""
    out: dict[str, dict[str, Any]] = {}
    other_tags = _by_tag(other)
    for tag, a in _by_tag(base).items():
        b = other_tags.get(tag)
        if b is None:
            continue
        pairs = [(x, y) for x, y in zip(a["greedy_success_by_seed"], b["greedy_success_by_seed"])
                 if x is not None and y is not None]
        if not pairs:
            continue
        xs, ys = [bool(x) for x, _ in pairs], [bool(y) for _, y in pairs]
        diff, low, high = paired_difference(xs, ys)
        out[tag] = {"seeds": len(pairs), "base": sum(xs) / len(xs), "other": sum(ys) / len(ys), "difference": diff,
                    "ci_low": low, "ci_high": high, "only_base": sum(x and not y for x, y in pairs),
                    "only_other": sum(y and not x for x, y in pairs)}
    return out


def format_comparison(base_name: str, other_name: str, rows: dict[str, dict[str, Any]]) -> str:
    head = f"{'tag':<14}{'seeds':>7}{'base':>8}{'other':>8}{'other-base':>12}{'95% CI':>18}{'only base':>11}{'only other':>12}"
    lines = [f"ragen eval --compare: base={base_name}  other={other_name}  (greedy, the same held-out seeds)", head,
             "-" * len(head)]
    for tag, r in rows.items():
        verdict = "" if r["ci_low"] <= 0 <= r["ci_high"] else ("  better" if r["ci_low"] > 0 else "  worse")
        interval = f"{r['ci_low']:+.3f} to {r['ci_high']:+.3f}"
        lines.append(f"{tag:<14}{r['seeds']:>7}{r['base']:>8.3f}{r['other']:>8.3f}{r['difference']:>+12.3f}"
                     f"{interval:>18}{r['only_base']:>11}{r['only_other']:>12}{verdict}")
    lines.append("")
    lines.append("other-base: paired difference of success rates, with its 95 % interval over the seeds (normal "
                 "approximation); 'better' / 'worse' where the interval excludes 0.")
    return "\n".join(lines)
