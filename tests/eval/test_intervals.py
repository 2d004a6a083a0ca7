"""95 % intervals: golden values from the formulas, and their invariants."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from ragen.eval.intervals import mean_interval, paired_difference, t975, wilson


def test_wilson_golden():
    # 8 of 10: centre (0.8 + 1.9208/10) / 1.38415 = 0.71668, half 1.96·sqrt(0.016 + 0.0096)/1.38415 = 0.22658
    assert wilson(8, 10) == pytest.approx((0.49016, 0.94332), abs=1e-5)
    assert wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)  # not empty at p̂ = 0
    assert wilson(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)
    assert wilson(0, 0) == (0.0, 1.0)


@given(st.integers(1, 500).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_contains_the_rate_and_stays_in_the_unit_interval(case):
    k, n = case
    low, high = wilson(k, n)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_mean_interval_golden():
    # mean 2, sd 1, t(2) = 4.303: 2 ± 4.303/√3
    assert mean_interval([1.0, 2.0, 3.0]) == pytest.approx((2.0, 2 - 2.48434, 2 + 2.48434), abs=1e-4)
    mean, low, high = mean_interval([0.5])
    assert mean == 0.5 and math.isnan(low) and math.isnan(high)  # one seed: no spread to bound
    with pytest.raises(ValueError):
        mean_interval([])


def test_t_quantiles():
    assert t975(1) == 12.706 and t975(7) == 2.365 and t975(30) == 2.042
    assert t975(1000) == pytest.approx(1.95996, abs=1e-5)
    with pytest.raises(ValueError):
        t975(0)


def test_paired_difference_golden():
    # differences (1, 1, 0, -1): mean 0.25, sd 0.9574, half 1.96·0.9574/2 = 0.93826
    assert paired_difference([0, 0, 1, 1], [1, 1, 1, 0]) == pytest.approx((0.25, -0.68826, 1.18826), abs=1e-4)
    same = [True, False, True]
    assert paired_difference(same, same) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="length"):
        paired_difference([True], [True, False])


def test_compare_reports_pairs_seeds_and_leaves_out_env_errors():
    from ragen.eval.compare import compare_reports, format_comparison

    base = {"env": "bandit", "tag": "Bandit", "greedy_success_by_seed": [0, 0, 1, 1, None]}
    other = {"env": "bandit", "tag": "Bandit", "greedy_success_by_seed": [1, 1, 1, 0, 1]}
    rows = compare_reports(base, other)
    r = rows["Bandit"]
    assert (r["seeds"], r["base"], r["other"], r["only_base"], r["only_other"]) == (4, 0.5, 0.75, 1, 2)
    assert (r["difference"], r["ci_low"], r["ci_high"]) == pytest.approx((0.25, -0.68826, 1.18826), abs=1e-4)
    table = format_comparison("a", "b", rows)
    assert "Bandit" in table and "+0.250" in table and "  better" not in table  # the interval holds 0


def test_ragen_eval_compare_runs_both_models_on_the_same_seeds(capsys):
    from ragen.cli import main

    assert main(["eval", "tiny", "bandit", "--k", "0", "--no-baselines", "--compare", "tiny",
                 "trainer.val_episodes=4", "rollout.max_new_tokens=4"]) == 0
    out = capsys.readouterr().out
    assert "ragen eval --compare: base=tiny  other=tiny" in out
    assert "+0.000" in out  # the same model on the same seeds, greedy: no difference
