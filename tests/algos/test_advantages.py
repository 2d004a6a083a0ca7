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


# ---------------------------------------------------------------------------------------------
# other outcome estimators on the shared batch (scores 3, 1, 2 | 1, 0 | 5)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False])
def test_dr_grpo_never_divides_by_std(norm):
    # score - group mean regardless of norm_adv_by_std: (1, -1, 0), (0.5, -0.5), single → 0
    out = get_adv_estimator("dr_grpo")(outcome_inputs(norm_adv_by_std=norm))
    assert_close(out.advantages, expand([1.0, -1.0, 0.0, 0.5, -0.5, 0.0]))


def test_brpo_golden():
    # batch mean (3+1+2+1+0+5)/6 = 2; deviations (1, -1, 0, -1, -2, 3), Σ dev² = 16
    # unbiased var 16/5 = 3.2 → std 1.7888544; eps = 0
    #   → 1/1.7888544 = 0.5590170, 2/1.7888544 = 1.1180340, 3/1.7888544 = 1.6770510
    out = get_adv_estimator("brpo")(outcome_inputs(eps=0.0))
    assert_close(out.advantages, expand([0.5590170, -0.5590170, 0.0, -0.5590170, -1.1180340, 1.6770510]))
    out = get_adv_estimator("brpo")(outcome_inputs(norm_adv_by_std=False))
    assert_close(out.advantages, expand([1.0, -1.0, 0.0, -1.0, -2.0, 3.0]))


def test_arpo_is_raw_score():
    out = get_adv_estimator("arpo")(outcome_inputs())
    assert_close(out.advantages, expand([3.0, 1.0, 2.0, 1.0, 0.0, 5.0]))


def test_rloo_golden():
    # group 0: 3 - (1+2)/2 = 1.5, 1 - (3+2)/2 = -1.5, 2 - (3+1)/2 = 0
    # group 5: 1 - 0 = 1, 0 - 1 = -1; group 9 (size 1): 0
    out = get_adv_estimator("rloo")(outcome_inputs())
    assert_close(out.advantages, expand([1.5, -1.5, 0.0, 1.0, -1.0, 0.0]))


def test_reinforce_pp_baseline_golden():
    # centred scores (1, -1, 0, 0.5, -0.5, 0) on 4, 3, 2, 3, 2, 1 masked tokens (15 tokens)
    # token mean = (4·1 - 3·1 + 0 + 3·0.5 - 2·0.5 + 0) / 15 = 1.5 / 15 = 0.1
    # Σ (x - 0.1)² = Σ x² - 15·0.1² = (4 + 3 + 0.75 + 0.5) - 0.15 = 8.1; unbiased var 8.1/14 = 0.5785714
    # std 0.7606388 → (1-0.1)/std = 1.1832160, (-1-0.1)/std = -1.4461528, (0-0.1)/std = -0.1314684,
    #                 (0.5-0.1)/std = 0.5258738, (-0.5-0.1)/std = -0.7888106
    out = get_adv_estimator("reinforce_pp_baseline")(outcome_inputs(eps=0.0))
    assert_close(
        out.advantages, expand([1.1832160, -1.4461528, -0.1314684, 0.5258738, -0.7888106, -0.1314684])
    )
    out = get_adv_estimator("reinforce_pp_baseline")(outcome_inputs(norm_adv_by_std=False))
    assert_close(out.advantages, expand([0.9, -1.1, -0.1, 0.4, -0.6, -0.1]))


def test_reinforce_pp_golden():
    # gamma = 0.5; discounting runs over model-written tokens only (position 2 of row 0 is env)
    # row 0: rewards [0, 1, 0, 0, 2], mask [1, 1, 0, 1, 1]
    #   G4 = 2, G3 = 0 + 0.5·2 = 1, G1 = 1 + 0.5·1 = 1.5, G0 = 0 + 0.5·1.5 = 0.75
    # row 1: rewards [0, 0, 4, 0, 0], mask [0, 1, 1, 0, 0]: G2 = 4, G1 = 0 + 0.5·4 = 2
    # whitening over (0.75, 1.5, 1, 2, 2, 4): mean 11.25/6 = 1.875,
    #   Σ dev² = 1.265625 + 0.140625 + 0.765625 + 0.015625 + 0.015625 + 4.515625 = 6.71875
    #   unbiased var 6.71875/5 = 1.34375, std 1.1592023
    #   → (-1.125, -0.375, -0.875, 0.125, 0.125, 2.125) / 1.1592023
    inp = AdvantageInputs(
        token_rewards=torch.tensor([[0.0, 1, 0, 0, 2], [0, 0, 4, 0, 0]]),
        response_mask=torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 0, 0]]),
        group_ids=torch.tensor([0, 0]),
        gamma=0.5,
        eps=0.0,
    )
    out = get_adv_estimator("reinforce_pp")(inp)
    assert_close(out.returns, torch.tensor([[0.75, 1.5, 0, 1, 2], [0, 2, 4, 0, 0]]))
    assert_close(
        out.advantages,
        torch.tensor([[-0.9704950, -0.3234983, 0, -0.7548294, 0.1078328], [0, 0.1078328, 1.8331571, 0, 0]]),
    )


ALL_ESTIMATORS = [
    "grpo", "dr_grpo", "brpo", "arpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
    "gae", "bi_level_gae", "gigpo",
]


@pytest.mark.parametrize("name", ALL_ESTIMATORS)
def test_every_estimator_has_uniform_contract(name):
    # same inputs for everyone; zero outside the mask; finite even with NaN values off-mask
    gen = torch.Generator().manual_seed(1)
    B, T = 6, 8
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    values = torch.randn(B, T, generator=gen)
    values[~mask] = float("nan")
    inp = AdvantageInputs(
        token_rewards=torch.randn(B, T, generator=gen) * mask,
        response_mask=mask,
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
        values=values,
        turn_ends=(torch.rand(B, T, generator=gen) > 0.6) & mask,
        anchor_ids=torch.where(mask, torch.randint(0, 3, (B, T), generator=gen), -1),
        step_returns=torch.randn(B, T, generator=gen),
    )
    out = get_adv_estimator(name)(inp)
    assert out.advantages.shape == (B, T) and out.returns.shape == (B, T)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.returns[mask]).all()
    assert (out.advantages[~mask] == 0).all()
    assert all(isinstance(v, float) for v in out.metrics.values())


@pytest.mark.parametrize("name", ["gae", "bi_level_gae", "gigpo"])
def test_missing_inputs_raise(name):
    with pytest.raises(ValueError, match=name):
        get_adv_estimator(name)(outcome_inputs())


# A group whose episodes all scored alike carries no signal: every group estimator gives it exactly 0 (GRPO:
# Â = (r − mean)/std with r = mean; the batch normalisers of the rest then see only zeros and equal values).
# In fp32, the mean of eight 9.9s is 1 ulp off 9.9, and (r − mean)/(std + 1e-6) made that −0.47 for every member.
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "brpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gigpo"])
@pytest.mark.parametrize("size", [3, 5, 6, 8])
def test_a_group_of_equal_returns_gets_exactly_zero_advantage(name, size):
    rewards = torch.zeros(2 * size, 3)
    rewards[:, -1] = torch.tensor([9.9] * size + [0.9] * size)  # two groups, each constant
    mask = torch.ones(2 * size, 3, dtype=torch.bool)
    inp = AdvantageInputs(rewards, mask, torch.tensor([0] * size + [1] * size),
                          anchor_ids=torch.zeros(2 * size, 3, dtype=torch.long),
                          step_returns=rewards.flip(-1).cumsum(-1).flip(-1),
                          turn_ends=torch.tensor([[False, False, True]] * (2 * size)))
    out = get_adv_estimator(name)(inp)
    if name in ("brpo", "reinforce_pp"):  # batch-level baselines: the two groups differ, so only within-group equality
        for group in (slice(0, size), slice(size, 2 * size)):
            assert torch.unique(out.advantages[group][:, -1]).numel() == 1
    else:
        assert (out.advantages == 0).all(), out.advantages


def test_equal_returns_paid_in_other_turns_are_equal_scores():
    """Turn rewards −0.1, −0.1, +9.9 in any order sum to the same return: the fp32 sums differ in the last bit by
    order, which GRPO's division by a near-zero std made into advantages of up to 0.6."""
    orders = [[-0.1, -0.1, 9.9], [-0.1, 9.9, -0.1], [9.9, -0.1, -0.1], [-0.1, -0.1, 9.9]]
    rewards = torch.tensor(orders)
    out = get_adv_estimator("grpo")(AdvantageInputs(rewards, torch.ones(4, 3, dtype=torch.bool), torch.zeros(4, dtype=torch.long)))
    assert (out.advantages == 0).all(), out.advantages
