"""Golden tests for the advantage estimators (numbers derived by hand in the comments)."""

from __future__ import annotations

import pytest
import torch

from ragen.algos import AdvantageInputs, get_adv_estimator

approx = lambda x: pytest.approx(x, rel=1e-5, abs=1e-6)  # noqa: E731


# ---------------------------------------------------------------------------------------------
# shared outcome batch: 6 sequences, T = 4, unequal lengths, rewards spread over tokens
# ---------------------------------------------------------------------------------------------
#   seq  group  token_rewards     response_mask   score
#   0    0      [0, 1, 0, 2]      [1, 1, 1, 1]    3
#   1    0      [0, 0, 1, 0]      [1, 1, 1, 0]    1
#   2    0      [0, 2, 0, 0]      [1, 1, 0, 0]    2
#   3    5      [0, 0, 0, 1]      [0, 1, 1, 1]    1   (leading non-response token)
#   4    5      [0, 0, 0, 0]      [1, 0, 1, 0]    0   (hole in the mask)
#   5    9      [5, 0, 0, 0]      [1, 0, 0, 0]    5   (group of size 1)
REWARDS = torch.tensor(
    [[0, 1, 0, 2], [0, 0, 1, 0], [0, 2, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0], [5, 0, 0, 0]], dtype=torch.float32
)
MASK = torch.tensor(
    [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 1, 0], [1, 0, 0, 0]], dtype=torch.bool
)
GROUPS = torch.tensor([0, 0, 0, 5, 5, 9])


def outcome_inputs(**kw) -> AdvantageInputs:
    return AdvantageInputs(token_rewards=REWARDS.clone(), response_mask=MASK.clone(), group_ids=GROUPS.clone(), **kw)


def expand(seq_adv: list[float]) -> torch.Tensor:
    """Expected (B, T) advantages: sequence value on masked tokens, 0 elsewhere."""
    return torch.tensor(seq_adv)[:, None] * MASK.float()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


class TestGRPO:
    def test_golden_std_normalised(self):
        # group 0: scores (3, 1, 2): mean 2, unbiased var ((1)^2 + (-1)^2 + 0^2) / (3 - 1) = 1 → std 1
        #   → (3-2)/(1+1e-6) = 0.999999, (1-2)/(1+1e-6) = -0.999999, 0
        # group 5: scores (1, 0): mean 0.5, unbiased var (0.25 + 0.25) / 1 = 0.5 → std 0.70710678
        #   → ±0.5 / (0.70710678 + 1e-6) ≈ ±0.7071058
        # group 9: single sequence → 0
        out = get_adv_estimator("grpo")(outcome_inputs())
        g0 = 1 / (1 + 1e-6)
        g5 = 0.5 / (0.70710678 + 1e-6)
        assert_close(out.advantages, expand([g0, -g0, 0.0, g5, -g5, 0.0]))
        assert_close(out.returns, out.advantages)
        # masked-out positions are exactly 0
        assert (out.advantages[~MASK] == 0).all()

    def test_golden_large_eps(self):
        # eps = 1: group 0 → (3-2)/(1+1) = 0.5, -0.5, 0; group 5 → ±0.5/(0.70710678+1) = ±0.29289322
        out = get_adv_estimator("grpo")(outcome_inputs(eps=1.0))
        assert_close(out.advantages, expand([0.5, -0.5, 0.0, 0.29289322, -0.29289322, 0.0]))

    def test_golden_no_std(self):
        # norm_adv_by_std=False: score - group mean → (1, -1, 0), (0.5, -0.5), single → 0
        out = get_adv_estimator("grpo")(outcome_inputs(norm_adv_by_std=False))
        assert_close(out.advantages, expand([1.0, -1.0, 0.0, 0.5, -0.5, 0.0]))

    def test_constant_group_gives_zero(self):
        # identical scores: std 0 → 0 / (0 + eps) = 0, no NaN
        inp = AdvantageInputs(
            token_rewards=torch.tensor([[0.0, 1.0], [0.0, 1.0]]),
            response_mask=torch.ones(2, 2),
            group_ids=torch.tensor([3, 3]),
        )
        out = get_adv_estimator("grpo")(inp)
        assert_close(out.advantages, torch.zeros(2, 2))

    def test_matches_torch_std_reference(self):
        gen = torch.Generator().manual_seed(0)
        B, T = 24, 7
        rewards = torch.randn(B, T, generator=gen)
        mask = torch.rand(B, T, generator=gen) > 0.3
        groups = torch.randint(0, 5, (B,), generator=gen)
        out = get_adv_estimator("grpo")(AdvantageInputs(rewards, mask, groups))
        scores = rewards.sum(-1)
        expected = torch.zeros(B)
        for g in groups.unique():
            idx = (groups == g).nonzero().flatten()
            if len(idx) > 1:
                s = scores[idx]
                expected[idx] = (s - s.mean()) / (torch.std(s, correction=1) + 1e-6)
        assert_close(out.advantages, expected[:, None] * mask.float())

    def test_metrics_are_floats(self):
        out = get_adv_estimator("grpo")(outcome_inputs())
        assert out.metrics and all(isinstance(v, float) for v in out.metrics.values())
        # scores (3, 1, 2, 1, 0, 5): mean 12/6 = 2
        assert out.metrics["adv/score_mean"] == approx(2.0)
