"""Golden tests for the policy / entropy losses and loss aggregation (hand-derived numbers)."""

from __future__ import annotations

import math

import pytest
import torch

from ragen.algos import aggregate_loss, clipped_policy_loss, entropy_loss, get_policy_loss, kl_penalty, value_loss

approx = lambda x: pytest.approx(x, rel=1e-5, abs=1e-6)  # noqa: E731

# B = 2 sequences, T = 3 tokens; last token of sequence 1 is not a loss token.
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [0.9, 1.1, 3.0]])
ADV = torch.tensor([[1.0, 2.0, -1.0], [-2.0, 1.0, -1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
OLD = torch.zeros(2, 3)
LOGP = RATIOS.log()  # ratio = exp(logp - 0)

# Per-token loss with clip_ratio_low = 0.2, clip_ratio_high = 0.28 (clip-higher):
#   (0,0) r=1.0, A= 1: max(-1.0, -1.0)                      = -1.0
#   (0,1) r=1.5, A= 2: max(-3.0, -2*1.28 = -2.56)           = -2.56   high clip active
#   (0,2) r=0.5, A=-1: max( 0.5,  1*0.8  =  0.8)            =  0.8    low clip active
#   (1,0) r=0.9, A=-2: max( 1.8,  1.8)                      =  1.8
#   (1,1) r=1.1, A= 1: max(-1.1, -1.1)                      = -1.1
#   (1,2) masked out (would be max(3, 1.28) = 3)
# token-mean          : (-1 - 2.56 + 0.8 + 1.8 - 1.1) / 5 = -2.06 / 5          = -0.412
# seq-mean-token-mean : ((-2.76 / 3) + (0.7 / 2)) / 2 = (-0.92 + 0.35) / 2    = -0.285
# seq-mean-token-sum  : (-2.76 + 0.7) / 2                                     = -1.03
GOLDEN_PG = {"token-mean": -0.412, "seq-mean-token-mean": -0.285, "seq-mean-token-sum": -1.03}


@pytest.mark.parametrize("mode", list(GOLDEN_PG))
def test_clipped_golden(mode):
    loss, metrics = clipped_policy_loss(
        LOGP, OLD, ADV, MASK, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode
    )
    assert float(loss.detach()) == approx(GOLDEN_PG[mode])
    assert metrics["actor/pg_loss"] == approx(GOLDEN_PG[mode])
    # one of 5 masked tokens each: high clip at (0,1), low clip at (0,2)
    assert metrics["actor/clipfrac_high"] == approx(0.2)
    assert metrics["actor/clipfrac_low"] == approx(0.2)
    # k1 = mean(old - logp) = -(ln1 + ln1.5 + ln0.5 + ln0.9 + ln1.1) / 5
    #    = -(0 + 0.4054651 - 0.6931472 - 0.1053605 + 0.0953102) / 5 = 0.2977324 / 5 = 0.0595465
    assert metrics["actor/approx_kl"] == approx(0.0595465)
    # (1 + 1.5 + 0.5 + 0.9 + 1.1) / 5 = 1.0 (the masked 3.0 is ignored)
    assert metrics["actor/ratio_mean"] == approx(1.0)


def test_registered_as_clipped():
    assert get_policy_loss("clipped") is clipped_policy_loss


def test_dual_clip_golden():
    # clip 0.2/0.2, dual clip c = 3:
    #   r=4, A=-1: max(4, 1.2) = 4 → A<0: min(4, 3) = 3        (dual clip active)
    #   r=4, A=+1: max(-4, -1.2) = -1.2 (dual clip only for A<0)
    #   r=2, A=-1: max(2, 1.2) = 2 → min(2, 3) = 2
    # token-mean: (3 - 1.2 + 2) / 3 = 3.8 / 3 = 1.2666667
    logp = torch.tensor([[4.0, 4.0, 2.0]]).log().requires_grad_()
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, metrics = clipped_policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_c=3.0)
    assert float(loss.detach()) == approx(1.2666667)
    assert metrics["actor/clipfrac_dual"] == approx(1 / 3)
    assert metrics["actor/clipfrac_high"] == approx(1 / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    # dual-clipped and high-clipped tokens carry no gradient; the third: d/dlogp(-A r)/3 = r/3 = 2/3
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 2 / 3]]))


def test_dual_clip_requires_c_above_one():
    with pytest.raises(ValueError):
        clipped_policy_loss(LOGP, OLD, ADV, MASK, clip_ratio_c=0.9)


# With ratio 1 (logprobs == old_logprobs) the clipped loss' gradient is the vanilla policy
# gradient of -A·logp, aggregated by the mode. Hand-derived, A and MASK as above:
#   token-mean          : -A·m / 5                  → [[-0.2, -0.4, 0.2], [0.4, -0.2, 0]]
#   seq-mean-token-mean : -A·m / (|o_b| · B=2)      → [[-1/6, -2/6, 1/6], [2/4, -1/4, 0]]
#   seq-mean-token-sum  : -A·m / 2                  → [[-0.5, -1.0, 0.5], [1.0, -0.5, 0]]
GOLDEN_GRAD = {
    "token-mean": [[-0.2, -0.4, 0.2], [0.4, -0.2, 0.0]],
    "seq-mean-token-mean": [[-1 / 6, -2 / 6, 1 / 6], [0.5, -0.25, 0.0]],
    "seq-mean-token-sum": [[-0.5, -1.0, 0.5], [1.0, -0.5, 0.0]],
}


@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
@pytest.mark.parametrize("mode", list(GOLDEN_GRAD))
def test_ratio_one_gradient_is_vanilla_pg(mode, clip_ratio_c):
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]], requires_grad=True)
    loss, _ = clipped_policy_loss(
        logp, logp.detach(), ADV, MASK, clip_ratio_low=0.2, clip_ratio_high=0.28,
        clip_ratio_c=clip_ratio_c, loss_agg_mode=mode,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor(GOLDEN_GRAD[mode]))
    # and equal to autograd of the vanilla objective aggregate(-A·logp)
    logp2 = logp.detach().clone().requires_grad_()
    (vanilla,) = torch.autograd.grad(aggregate_loss(-ADV * logp2, MASK, mode), logp2)
    torch.testing.assert_close(grad, vanilla)


def test_masked_positions_do_not_leak():
    # NaN / huge values outside the mask change neither loss nor gradient
    logp = LOGP.clone().requires_grad_()
    old = OLD.clone()
    adv = ADV.clone()
    old[1, 2] = float("nan")
    adv[1, 2] = float("inf")
    loss, metrics = clipped_policy_loss(logp, old, adv, MASK, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert float(loss.detach()) == approx(-0.412)
    assert all(math.isfinite(v) for v in metrics.values())
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(grad).all() and grad[1, 2] == 0


# ---------------------------------------------------------------------------------------------
# entropy + aggregation
# ---------------------------------------------------------------------------------------------
ENT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
ENT_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
# token-mean          : (1 + 2 + 4) / 3             = 2.3333333
# seq-mean-token-mean : ((1 + 2) / 2 + 4 / 1) / 2   = (1.5 + 4) / 2 = 2.75
# seq-mean-token-sum  : ((1 + 2) + 4) / 2           = 3.5
GOLDEN_ENT = {"token-mean": 7 / 3, "seq-mean-token-mean": 2.75, "seq-mean-token-sum": 3.5}


@pytest.mark.parametrize("mode", list(GOLDEN_ENT))
def test_entropy_loss_golden(mode):
    assert float(entropy_loss(ENT, ENT_MASK, mode)) == approx(GOLDEN_ENT[mode])


# ---------------------------------------------------------------------------------------------
# KL penalty
# ---------------------------------------------------------------------------------------------
# x = logp - ref: column 0: ln0.5 - ln0.25 = ln2 = 0.6931472; column 1: ln0.25 - ln0.5 = -0.6931472
#   k1 = x                   → 0.6931472, -0.6931472
#   k2 = x²/2 = 0.480453/2   → 0.2402265,  0.2402265
#   k3 = e^{-x} - 1 + x      → 0.5 - 1 + 0.6931472 = 0.1931472,  2 - 1 - 0.6931472 = 0.3068528
KL_GOLDEN = {"k1": [0.6931472, -0.6931472], "k2": [0.2402265, 0.2402265], "k3": [0.1931472, 0.3068528]}


@pytest.mark.parametrize("kind", list(KL_GOLDEN))
def test_kl_penalty_golden(kind):
    logp = torch.tensor([[0.5, 0.25]]).log()
    ref = torch.tensor([[0.25, 0.5]]).log()
    torch.testing.assert_close(kl_penalty(logp, ref, kind), torch.tensor([KL_GOLDEN[kind]]))


def test_kl_penalty_zero_at_equal_policies_and_unknown_kind():
    x = torch.randn(3, 4)
    for kind in KL_GOLDEN:
        assert torch.equal(kl_penalty(x, x, kind), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(x, x, "k9")


# ---------------------------------------------------------------------------------------------
# value loss (PPO value clipping), clip_range_value = 0.2
# ---------------------------------------------------------------------------------------------
#   (0,0) v=1.0 old=0.8 R=1.5: v_clip = 0.8 + 0.2 = 1.0; max(0.25, 0.25)          = 0.25
#   (0,1) v=2.0 old=1.0 R=1.0: v_clip = 1.2;       max((1)², (0.2)² = 0.04)        = 1.0
#   (1,0) v=0.0 old=0.5 R=1.0: v_clip = 0.3;       max(1, (0.7)² = 0.49)           = 1.0
#   (1,1) v=3.0 old=2.0 R=3.0: v_clip = 2.2;       max(0, (0.8)² = 0.64)           = 0.64  clipped
#   (·,2) masked out
# token-mean: ½ (0.25 + 1 + 1 + 0.64) / 4 = ½ · 0.7225 = 0.36125; without clipping ½ · 2.25/4 = 0.28125
# seq-mean-token-sum: ½ ((0.25 + 1) + (1 + 0.64)) / 2 = ½ · 1.445 = 0.7225
V = torch.tensor([[1.0, 2.0, 0.5], [0.0, 3.0, 7.0]])
V_OLD = torch.tensor([[0.8, 1.0, 0.5], [0.5, 2.0, 0.0]])
V_RET = torch.tensor([[1.5, 1.0, 3.0], [1.0, 3.0, 0.0]])
V_MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])


@pytest.mark.parametrize(
    "clip,mode,expected",
    [(0.2, "token-mean", 0.36125), (None, "token-mean", 0.28125), (0.2, "seq-mean-token-sum", 0.7225)],
)
def test_value_loss_golden(clip, mode, expected):
    loss, metrics = value_loss(V, V_OLD, V_RET, V_MASK, clip_range_value=clip, loss_agg_mode=mode)
    assert float(loss) == approx(expected)
    assert metrics["critic/vf_loss"] == approx(expected)
    assert metrics["critic/vf_clipfrac"] == approx(0.25 if clip else 0.0)
    assert metrics["critic/vpred_mean"] == approx(1.5)  # (1 + 2 + 0 + 3) / 4


def test_value_loss_clipped_token_has_no_gradient():
    v = V.clone().requires_grad_()
    loss, _ = value_loss(v, V_OLD, V_RET, V_MASK, clip_range_value=0.2)
    (grad,) = torch.autograd.grad(loss, v)
    # ½ · 2 (v - R) / 4 on unclipped-selected tokens: (1-1.5)/4 = -0.125, (2-1)/4 = 0.25, (0-1)/4 = -0.25;
    # (1,1) selects the clipped branch, whose v_clip is saturated → 0; masked tokens → 0
    torch.testing.assert_close(grad, torch.tensor([[-0.125, 0.25, 0.0], [-0.25, 0.0, 0.0]]))
