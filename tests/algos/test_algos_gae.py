"""Token-level estimators with a critic (gae, bi_level_gae) and GiGPO: golden numbers,
invariance to values at non-response tokens, and equivalence with simple per-sequence loops."""

from __future__ import annotations

import pytest
import torch

from ragen.algos import AdvantageInputs, get_adv_estimator
from ragen.algos.core import masked_whiten


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# gae
# ---------------------------------------------------------------------------------------------
# gamma = 0.9, lam = 0.8 (γλ = 0.72)
# row 0: rewards [0, 0, 0, 1], values [0.5, 9.0, 0.4, 0.6], mask [1, 0, 1, 1] (position 1 = env token)
#   t=3: δ = 1 + 0.9·0 - 0.6 = 0.4                      A3 = 0.4
#   t=2: δ = 0 + 0.9·0.6 - 0.4 = 0.14                   A2 = 0.14 + 0.72·0.4 = 0.428
#   t=0: δ = 0 + 0.9·0.4 - 0.5 = -0.14  (skips t=1)     A0 = -0.14 + 0.72·0.428 = 0.16816
#   returns = A + V = 0.66816, 0, 0.828, 1.0
# row 1: rewards [0, 2, 0, 0], values [1, 1, 7, 7], mask [1, 1, 0, 0] (padding after)
#   t=1: δ = 2 - 1 = 1                                  A1 = 1
#   t=0: δ = 0 + 0.9·1 - 1 = -0.1                       A0 = -0.1 + 0.72·1 = 0.62
#   returns = 1.62, 2.0
# centring (norm_adv_by_std=False): mean(0.16816, 0.428, 0.4, 0.62, 1) = 2.61616 / 5 = 0.523232
GAE_INPUT = dict(
    token_rewards=torch.tensor([[0.0, 0, 0, 1], [0, 2, 0, 0]]),
    response_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.bool),
    group_ids=torch.tensor([0, 1]),
    values=torch.tensor([[0.5, 9.0, 0.4, 0.6], [1.0, 1.0, 7.0, 7.0]]),
    gamma=0.9,
    lam=0.8,
)
GAE_RAW = torch.tensor([[0.16816, 0, 0.428, 0.4], [0.62, 1.0, 0, 0]])
GAE_RETURNS = torch.tensor([[0.66816, 0, 0.828, 1.0], [1.62, 2.0, 0, 0]])


def test_gae_golden_centred():
    out = get_adv_estimator("gae")(AdvantageInputs(**GAE_INPUT, norm_adv_by_std=False))
    assert_close(out.returns, GAE_RETURNS)
    mask = GAE_INPUT["response_mask"]
    assert_close(out.advantages, torch.where(mask, GAE_RAW - 0.523232, 0.0))


# whitening (norm_adv_by_std=True): mean 0.523232, unbiased std 0.3110479 over the five response tokens,
# (A − mean) / (std + 1e-6) = -1.141531, -0.306164, -0.396182, 0.311102, 1.532775 (positions (0,0), (0,2), (0,3),
# (1,0), (1,1)); written out rather than computed with masked_whiten, which the estimator itself calls
GAE_WHITENED = torch.tensor([[-1.141531, 0, -0.306164, -0.396182], [0.311102, 1.532775, 0, 0]])


def test_gae_golden_whitened():
    out = get_adv_estimator("gae")(AdvantageInputs(**GAE_INPUT))
    assert_close(out.returns, GAE_RETURNS)
    assert_close(out.advantages, GAE_WHITENED)
    assert_close(masked_whiten(GAE_RAW, GAE_INPUT["response_mask"], eps=1e-6), GAE_WHITENED)


# ---------------------------------------------------------------------------------------------
# bi-level gae
# ---------------------------------------------------------------------------------------------
# one sequence, two turns: [tok, tok(end 1, R=1), env, tok, tok(end 2, R=2), pad]
# gamma = 0.9, lam = 0.8 (γλ = 0.72), high_level_gamma = 0.5 (γ_H·λ = 0.4)
# turn level (values at turn ends V1 = 0.5, V2 = 0.6):
#   δH2 = 2 + 0 - 0.6 = 1.4                 AH2 = 1.4
#   δH1 = 1 + 0.5·0.6 - 0.5 = 0.8           AH1 = 0.8 + 0.4·1.4 = 1.36
# token level:
#   A4 = AH2 = 1.4;  t=3: δ = 0 + 0.9·0.6 - 0.3 = 0.24,  A3 = 0.24 + 0.72·1.4 = 1.248
#   A1 = AH1 = 1.36; t=0: δ = 0 + 0.9·0.5 - 0.2 = 0.25,  A0 = 0.25 + 0.72·1.36 = 1.2292
# returns = A + V = 1.4292, 1.86, 0, 1.548, 2.0, 0
BI_INPUT = dict(
    token_rewards=torch.tensor([[0.0, 1, 0, 0, 2, 0]]),
    response_mask=torch.tensor([[1, 1, 0, 1, 1, 0]], dtype=torch.bool),
    group_ids=torch.tensor([0]),
    values=torch.tensor([[0.2, 0.5, 9.0, 0.3, 0.6, 9.0]]),
    turn_ends=torch.tensor([[0, 1, 0, 0, 1, 0]], dtype=torch.bool),
    gamma=0.9,
    lam=0.8,
    high_level_gamma=0.5,
)


def test_bi_level_gae_golden():
    out = get_adv_estimator("bi_level_gae")(AdvantageInputs(**BI_INPUT, norm_adv_by_std=False))
    assert_close(out.returns, torch.tensor([[1.4292, 1.86, 0, 1.548, 2.0, 0]]))
    raw = torch.tensor([[1.2292, 1.36, 0, 1.248, 1.4, 0]])
    mean = (1.2292 + 1.36 + 1.248 + 1.4) / 4  # 5.2372 / 4 = 1.3093
    assert_close(out.advantages, torch.where(BI_INPUT["response_mask"], raw - mean, 0.0))


def test_bi_level_turn_boundaries_come_from_turn_ends_not_rewards():
    # no turn ends + rewards on many tokens → one turn → identical to token-level gae
    gen = torch.Generator().manual_seed(3)
    inp = random_inputs(gen, B=5, T=9)
    inp.turn_ends = torch.zeros_like(inp.response_mask)
    bi = get_adv_estimator("bi_level_gae")(inp)
    flat = get_adv_estimator("gae")(inp)
    assert_close(bi.advantages, flat.advantages)
    assert_close(bi.returns, flat.returns)


# ---------------------------------------------------------------------------------------------
# references: plain per-sequence loops over the list of response positions
# ---------------------------------------------------------------------------------------------


def reference_gae_row(rewards, values, positions, gamma, lam, fixed=None):
    """GAE over ``positions`` (list of ints) of one row; ``fixed``: {position: advantage}."""
    adv, next_v, next_a = {}, 0.0, 0.0
    for t in reversed(positions):
        a = rewards[t] + gamma * next_v - values[t] + gamma * lam * next_a
        if fixed and t in fixed:
            a = fixed[t]
        adv[t], next_v, next_a = a, values[t], a
    return adv


def reference_bi_level_row(rewards, values, mask, turn_ends, gamma, lam, high_gamma):
    positions = [t for t in range(len(mask)) if mask[t]]
    ends = [t for t in positions if turn_ends[t]]
    if positions and positions[-1] not in ends:
        ends.append(positions[-1])
    turn_adv = reference_gae_row(rewards, values, ends, high_gamma, lam)
    return reference_gae_row(rewards, values, positions, gamma, lam, fixed=turn_adv)


def random_inputs(gen, B=7, T=12):
    mask = torch.rand(B, T, generator=gen) > 0.35
    mask[-1] = False  # a sequence with no response tokens at all
    return AdvantageInputs(
        token_rewards=torch.randn(B, T, generator=gen, dtype=torch.float64),
        response_mask=mask,
        group_ids=torch.arange(B),
        values=torch.randn(B, T, generator=gen, dtype=torch.float64),
        turn_ends=(torch.rand(B, T, generator=gen) > 0.7) & mask,
        gamma=0.93,
        lam=0.87,
        high_level_gamma=0.8,
        norm_adv_by_std=False,
    )


def loop_result(inp, row_fn):
    raw = torch.zeros_like(inp.token_rewards)
    for b in range(raw.shape[0]):
        r, v, m = inp.token_rewards[b].tolist(), inp.values[b].tolist(), inp.response_mask[b].tolist()
        for t, a in row_fn(r, v, m, inp.turn_ends[b].tolist()).items():
            raw[b, t] = a
    return raw


def GAE_ROW(inp):
    return lambda r, v, m, e: reference_gae_row(r, v, [t for t in range(len(m)) if m[t]], inp.gamma, inp.lam)


def BI_ROW(inp):
    return lambda r, v, m, e: reference_bi_level_row(r, v, m, e, inp.gamma, inp.lam, inp.high_level_gamma)


@pytest.mark.parametrize("name,row", [("gae", GAE_ROW), ("bi_level_gae", BI_ROW)])
@pytest.mark.parametrize("seed", range(4))
def test_vectorised_matches_loop(name, row, seed):
    inp = random_inputs(torch.Generator().manual_seed(seed))
    out = get_adv_estimator(name)(inp)
    raw = loop_result(inp, row(inp))
    mask = inp.response_mask
    assert_close(out.returns, torch.where(mask, raw + inp.values, 0.0))
    assert_close(out.advantages, torch.where(mask, raw - raw[mask].mean(), 0.0))


@pytest.mark.parametrize("name", ["gae", "bi_level_gae"])
@pytest.mark.parametrize("norm", [True, False])
def test_values_outside_mask_never_matter(name, norm):
    gen = torch.Generator().manual_seed(11)
    inp = random_inputs(gen)
    inp.norm_adv_by_std = norm
    base = get_adv_estimator(name)(inp)
    for junk in (torch.randn(inp.values.shape, generator=gen, dtype=torch.float64) * 100, float("nan")):
        inp.values = torch.where(inp.response_mask, inp.values, junk)
        out = get_adv_estimator(name)(inp)
        assert_close(out.advantages, base.advantages)
        assert_close(out.returns, base.returns)


# ---------------------------------------------------------------------------------------------
# gigpo
# ---------------------------------------------------------------------------------------------
# one group of 3 trajectories, T = 5: [turn 1, turn 1 (end), env, turn 2, turn 2 (end)]
#   row 0: reward 1 at the end; turn 1 at anchor state 10 (return 0.5), turn 2 at state 11 (return 1)
#   row 1: reward 0;            turn 1 at state 10 (return 0),        turn 2 at state 12 (return 0)
#   row 2: reward 0; a single truncated turn (no turn end flag) at state 10 (return 0)
# episode: scores (1, 0, 0): mean 1/3, unbiased std sqrt((4/9 + 1/9 + 1/9) / 2) = 0.5773503
#   A^E = (2/3)/0.5773503 = 1.1547005, -0.5773503, -0.5773503
# step, anchor (group 0, state 10): returns (0.5, 0, 0): mean 1/6,
#   unbiased std sqrt((1/9 + 1/36 + 1/36) / 2) = sqrt(1/12) = 0.2886751
#   A^S = (1/3)/0.2886751 = 1.1547005, -0.5773503, -0.5773503; states 11, 12 visited once → 0
# ω = 0.5: row 0 turn 1: 1.1547005 + 0.5774 = 1.7320508; row 0 turn 2: 1.1547005
#          row 1 turn 1: -0.5773503 - 0.2886751 = -0.8660254; row 1 turn 2: -0.5773503
#          row 2 turn 1: -0.8660254
GIGPO_INPUT = dict(
    token_rewards=torch.tensor([[0.0, 0, 0, 0, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]),
    response_mask=torch.tensor([[1, 1, 0, 1, 1], [1, 1, 0, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool),
    group_ids=torch.tensor([0, 0, 0]),
    turn_ends=torch.tensor([[0, 1, 0, 0, 1], [0, 1, 0, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.bool),
    anchor_ids=torch.tensor([[10, 10, -1, 11, 11], [10, 10, -1, 12, 12], [10, 10, -1, -1, -1]]),
    step_returns=torch.tensor([[0.5, 0.5, 0, 1, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]),
    gigpo_step_weight=0.5,
    eps=0.0,
)


def test_gigpo_golden():
    out = get_adv_estimator("gigpo")(AdvantageInputs(**GIGPO_INPUT))
    s3, h3 = 1.7320508, 0.8660254  # √3, √3/2
    expected = torch.tensor(
        [[s3, s3, 0, 1.1547005, 1.1547005], [-h3, -h3, 0, -0.5773503, -0.5773503], [-h3, -h3, 0, 0, 0]]
    )
    assert_close(out.advantages, expected)
    assert_close(out.returns, out.advantages)
    # 3 of the 5 anchored turns share a state with another turn
    assert out.metrics["adv/gigpo_step_nontrivial_frac"] == pytest.approx(0.6)


def test_gigpo_golden_without_std():
    # F_norm = 1: A^E = (2/3, -1/3, -1/3), A^S(state 10) = (1/3, -1/6, -1/6)
    # row 0 turn 1: 2/3 + 0.5/3 = 5/6; row 1 turn 1: -1/3 - 1/12 = -5/12
    out = get_adv_estimator("gigpo")(AdvantageInputs(**{**GIGPO_INPUT, "norm_adv_by_std": False}))
    expected = torch.tensor(
        [[5 / 6, 5 / 6, 0, 2 / 3, 2 / 3], [-5 / 12, -5 / 12, 0, -1 / 3, -1 / 3], [-5 / 12, -5 / 12, 0, 0, 0]]
    )
    assert_close(out.advantages, expected)


def test_gigpo_anchor_groups_do_not_cross_episode_groups():
    # same anchor id 10 in two different groups → each anchor group has one turn → A^S = 0
    inp = AdvantageInputs(**{**GIGPO_INPUT, "group_ids": torch.tensor([0, 1, 2])})
    out = get_adv_estimator("gigpo")(inp)
    assert_close(out.advantages, torch.zeros(3, 5))  # every episode group has size 1 too


def test_gigpo_zero_step_weight_is_grpo():
    inp = AdvantageInputs(**{**GIGPO_INPUT, "gigpo_step_weight": 0.0})
    assert_close(get_adv_estimator("gigpo")(inp).advantages, get_adv_estimator("grpo")(inp).advantages)
