"""Masked reductions, grouped statistics, aggregation modes and the registry."""

from __future__ import annotations

import pytest
import torch

from ragen.algos import aggregate_loss, get_adv_estimator, get_policy_loss, register_adv_estimator
from ragen.algos.core import group_stats, masked_mean, masked_sum, masked_var, masked_whiten
from ragen.algos.registry import ADV_ESTIMATORS

approx = lambda x: pytest.approx(x, rel=1e-5, abs=1e-6)  # noqa: E731

X = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)


def test_masked_sum_mean_ignore_nan_outside_mask():
    assert float(masked_sum(X, M)) == approx(13.0)  # 1 + 2 + 4 + 6
    assert float(masked_mean(X, M)) == approx(3.25)  # 13 / 4
    torch.testing.assert_close(masked_sum(X, M, dim=-1), torch.tensor([3.0, 10.0]))
    torch.testing.assert_close(masked_mean(X, M, dim=-1), torch.tensor([1.5, 5.0]))


def test_masked_mean_float_mask_and_empty():
    assert float(masked_mean(torch.ones(2, 2), torch.zeros(2, 2))) == 0.0
    torch.testing.assert_close(masked_mean(X, M.float(), dim=-1), torch.tensor([1.5, 5.0]))


def test_masked_var_and_whiten():
    # values 1, 2, 4, 6: mean 3.25, squared devs 5.0625 + 1.5625 + 0.5625 + 7.5625 = 14.75
    # unbiased var 14.75 / 3 = 4.9166667, std 2.2173558
    assert float(masked_var(X, M)) == approx(14.75 / 3)
    w = masked_whiten(X, M, eps=0.0)
    expected = torch.tensor([[(1 - 3.25), (2 - 3.25), 0.0], [(4 - 3.25), 0.0, (6 - 3.25)]]) / 2.2173558
    torch.testing.assert_close(w, expected)


def test_group_stats_matches_loop():
    x = torch.tensor([1.0, 3.0, 5.0, 7.0, 2.0])
    keys = torch.tensor([4, 4, 9, 9, 1])
    mean, std, count = group_stats(x, keys)
    # group 4: mean 2, unbiased std sqrt((1 + 1) / 1) = 1.4142136; group 9: mean 6, same std;
    # group 1: single → std 0
    torch.testing.assert_close(mean, torch.tensor([2.0, 2.0, 6.0, 6.0, 2.0]))
    torch.testing.assert_close(std, torch.tensor([1.4142136, 1.4142136, 1.4142136, 1.4142136, 0.0]))
    torch.testing.assert_close(count, torch.tensor([2.0, 2.0, 2.0, 2.0, 1.0]))


def test_group_stats_composite_keys():
    # rows (0, 1) and (0, 1) share a group; (1, 1) is separate
    x = torch.tensor([1.0, 3.0, 10.0])
    keys = torch.tensor([[0, 1], [0, 1], [1, 1]])
    mean, _, count = group_stats(x, keys)
    torch.testing.assert_close(mean, torch.tensor([2.0, 2.0, 10.0]))
    torch.testing.assert_close(count, torch.tensor([2.0, 2.0, 1.0]))


# aggregation: row 2 has no tokens and must be excluded from the seq-mean modes
LOSS = torch.tensor([[1.0, 3.0, 100.0], [2.0, 2.0, 2.0], [50.0, 50.0, 50.0]])
LMASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
# token-mean          : (1 + 3 + 2 + 2 + 2) / 5 = 10 / 5          = 2.0
# seq-mean-token-mean : (4/2 + 6/3) / 2 = (2 + 2) / 2             = 2.0
# seq-mean-token-sum  : (4 + 6) / 2                                = 5.0
AGG_GOLDEN = {"token-mean": 2.0, "seq-mean-token-mean": 2.0, "seq-mean-token-sum": 5.0}


@pytest.mark.parametrize("mode", list(AGG_GOLDEN))
def test_aggregate_golden(mode):
    assert float(aggregate_loss(LOSS, LMASK, mode)) == approx(AGG_GOLDEN[mode])


def test_aggregate_modes_differ_on_unequal_lengths():
    # seq 0: 1 token of loss 4; seq 1: 4 tokens of loss 1
    loss = torch.tensor([[4.0, 0, 0, 0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    assert float(aggregate_loss(loss, mask, "token-mean")) == approx(8 / 5)  # (4 + 4) / 5
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean")) == approx(2.5)  # (4 + 1) / 2
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum")) == approx(4.0)  # (4 + 4) / 2


@pytest.mark.parametrize("mode", list(AGG_GOLDEN))
def test_aggregate_nothing_masked_is_zero(mode):
    assert float(aggregate_loss(torch.ones(2, 3), torch.zeros(2, 3), mode)) == 0.0


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(LOSS, LMASK, "bogus")


def test_registry_unknown_names_list_known():
    with pytest.raises(ValueError, match="grpo"):
        get_adv_estimator("nope")
    with pytest.raises(ValueError, match="clipped"):
        get_policy_loss("nope")


def test_registry_rejects_conflicting_registration():
    with pytest.raises(ValueError):
        register_adv_estimator("grpo")(lambda inp: inp)
    assert "grpo" in ADV_ESTIMATORS
