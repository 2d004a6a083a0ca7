"""StarPO-S uncertainty filtering: golden selections and metrics."""

from __future__ import annotations

import pytest
import torch

from ragen.algos import uncertainty_filter

approx = lambda x: pytest.approx(x, rel=1e-5, abs=1e-6)  # noqa: E731

# 4 groups of 2, interleaved in the batch, non-contiguous ids:
#   id 3: scores (1, 1) → std 0
#   id 5: scores (0, 2) → unbiased std sqrt((1 + 1) / 1) = √2      = 1.4142136
#   id 8: scores (0, 1) → sqrt((0.25 + 0.25) / 1) = √0.5           = 0.7071068
#   id 9: scores (0, 4) → sqrt((4 + 4) / 1) = √8                    = 2.8284271
# ranking: 9 > 5 > 8 > 3; std shares ∝ (2, 1, 0.5, 0) → 4/7, 2/7, 1/7, 0; cumulative 4/7, 6/7, 1, 1
# std_before = (0 + 1.4142136 + 0.7071068 + 2.8284271) / 4 = 4.9497475 / 4 = 1.2374369
GROUPS = torch.tensor([3, 5, 8, 9, 3, 5, 8, 9])
SCORES = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 2.0, 1.0, 4.0])
KEEP = {  # group ids kept
    ("top_k", 0.25): {9},  # ⌊0.25·4⌋ = 1
    ("top_k", 0.5): {9, 5},  # ⌊0.5·4⌋ = 2
    ("top_k", 0.1): {9},  # ⌊0.4⌋ = 0 → at least 1
    ("top_p", 0.25): {9},  # 4/7 ≥ 0.25
    ("top_p", 0.6): {9, 5},  # 4/7 < 0.6 ≤ 6/7
    ("top_p", 0.9): {9, 5, 8},  # 6/7 < 0.9 ≤ 1
    ("top_p", 1.0): {3, 5, 8, 9},  # keep_ratio ≥ 1 keeps everything
}
STD = {3: 0.0, 5: 1.4142136, 8: 0.7071068, 9: 2.8284271}


@pytest.mark.parametrize("mode,ratio", list(KEEP))
def test_uncertainty_filter_golden(mode, ratio):
    keep, metrics = uncertainty_filter(SCORES, GROUPS, keep_ratio=ratio, mode=mode)
    kept = KEEP[(mode, ratio)]
    assert keep.tolist() == [int(g) in kept for g in GROUPS]
    assert metrics["filter/kept_ratio"] == approx(2 * len(kept) / 8)
    assert metrics["filter/std_before"] == approx(1.2374369)
    assert metrics["filter/std_after"] == approx(sum(STD[g] for g in kept) / len(kept))


def test_all_zero_std_top_p_is_uniform():
    # no signal anywhere: shares 1/4 each → keep_ratio 0.5 keeps 2 groups (lowest ids on ties)
    keep, metrics = uncertainty_filter(torch.ones(8), GROUPS, keep_ratio=0.5, mode="top_p")
    assert keep.tolist() == [int(g) in {3, 5} for g in GROUPS]
    assert metrics["filter/std_after"] == 0.0


def test_unknown_mode_and_bad_ratio():
    with pytest.raises(ValueError, match="top_k"):
        uncertainty_filter(SCORES, GROUPS, mode="nope")
    with pytest.raises(ValueError):
        uncertainty_filter(SCORES, GROUPS, keep_ratio=0.0)


@pytest.mark.parametrize("groups", range(2, 41))
@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.25, 0.3, 0.5, 0.6, 0.75, 0.9])
def test_top_p_over_equal_stds_keeps_the_share_asked(groups, ratio):
    """G groups of equal std have equal shares 1/G: top_p keeps the fewest whose share reaches the ratio,
    ⌈ratio·G⌉ (in fp32 the cumulative shares fell below k/G and one group too many was kept, e.g. 7 of 24 at 0.25)."""
    import math

    scores = torch.tensor([1.0, 0.0] * groups)  # every group one success of two: std 0.7071068
    keep, _ = uncertainty_filter(scores, torch.arange(groups).repeat_interleave(2), keep_ratio=ratio, mode="top_p")
    assert int(keep.sum()) // 2 == max(1, math.ceil(ratio * groups - 1e-9))


# Groups of two scores (0, a): std a/√2, so the std shares are the a's shares exactly in real arithmetic.
# (0.3, 0.1, 0.1, 0.1) at keep_ratio 0.5: the first group alone holds exactly half; (0.5, 0.1, 0.1, 0.1) at 0.625
# and 0.875; (0.3, 0.3, 0.1, 0.1) at 0.375 and 0.75. Summed in fp32 these shares land just below the ratio.
BOUNDARY_CASES = [
    ((0.3, 0.1, 0.1, 0.1), 0.5, 1),
    ((0.5, 0.1, 0.1, 0.1), 0.625, 1),
    ((0.5, 0.1, 0.1, 0.1), 0.75, 2),
    ((0.5, 0.1, 0.1, 0.1), 0.875, 3),
    ((0.9, 0.1, 0.1, 0.1), 0.75, 1),
    ((0.3, 0.3, 0.1, 0.1), 0.375, 1),
    ((0.3, 0.3, 0.1, 0.1), 0.75, 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("payoffs,ratio,groups_kept", BOUNDARY_CASES)
def test_top_p_at_an_exact_share_boundary_keeps_the_fewest_groups(payoffs, ratio, groups_kept, dtype):
    """A cumulative share that equals filter_ratio in real arithmetic reaches it, whatever the rewards' dtype."""
    scores = torch.tensor([x for a in payoffs for x in (0.0, a)], dtype=dtype)
    keep, metrics = uncertainty_filter(scores, torch.arange(4).repeat_interleave(2), keep_ratio=ratio, mode="top_p")
    assert metrics["filter/kept_groups"] == groups_kept
    assert keep.tolist() == [g < groups_kept for g in range(4) for _ in range(2)]


def test_ragen_top_p_keeps_no_group_when_no_group_has_spread():
    keep, metrics = uncertainty_filter(torch.ones(8), GROUPS, keep_ratio=0.5, mode="top_p_ragen")
    assert not keep.any()
    assert metrics["filter/kept_groups"] == 0 and metrics["filter/std_after"] == 0.0
    # ragen's own rule keeps the uniform ⌈pG⌉ instead (test_all_zero_std_top_p_is_uniform)


@pytest.mark.parametrize("ratio,kept", [(0.25, {9}), (0.6, {9, 5}), (0.9, {9, 5, 8}), (0.999, {9, 5, 8})])
def test_ragen_top_p_golden(ratio, kept):
    """Target p·Σstd − 0.01 with Σstd = 4.9497: 0.25 → 1.227 (9 alone: 2.83), 0.6 → 2.96 (9 + 5: 4.24),
    0.9 → 4.44 (9 + 5 + 8: 4.95); at 0.999 the zero-std group 3 is never added."""
    keep, _ = uncertainty_filter(SCORES, GROUPS, keep_ratio=ratio, mode="top_p_ragen")
    assert keep.tolist() == [int(g) in kept for g in GROUPS]


def test_ragen_top_p_keeps_none_when_the_summed_std_is_below_its_slack():
    scores = torch.tensor([0.0, 0.01, 0.0, 0.0])  # one group of std 0.00707: 0.5 · 0.00707 − 0.01 < 0
    keep, _ = uncertainty_filter(scores, torch.tensor([0, 0, 1, 1]), keep_ratio=0.5, mode="top_p_ragen")
    assert not keep.any()
    keep, _ = uncertainty_filter(scores, torch.tensor([0, 0, 1, 1]), keep_ratio=0.5, mode="top_p")
    assert keep.tolist() == [True, True, False, False]
