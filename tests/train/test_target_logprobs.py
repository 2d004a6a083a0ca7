"""The hand-written target log-prob (and entropy metric) equals autograd's log_softmax + gather, values and gradients."""

from __future__ import annotations

import pytest
import torch

import ragen.train.target_logprobs as target_module
from ragen.train.logprobs import policy_forward
from ragen.train.target_logprobs import TargetLogProbs, target_logprobs


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The plain path: fp32 (or wider) log-softmax of z/T, gathered; entropy -Σ π log π."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(z, -1)
    return logp_all.gather(1, targets[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)


def case(n=300, V=1000, dtype=torch.float32, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(n, V, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(V, (n,), generator=g)
    return logits, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("n", [1, 127, 300])  # one row, under one block, three blocks with a partial one
def test_values_and_gradients_equal_log_softmax_gather(temperature, n):
    logits, targets = case(n=n)
    logp, entropy = target_logprobs(logits, targets, temperature, with_entropy=True)
    want_logp, want_entropy = reference(logits, targets, temperature)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy.detach(), rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad and target_logprobs(logits, targets, temperature)[1] is None
    weights = torch.linspace(-1, 2, n)  # (n,) an arbitrary upstream gradient
    got, = torch.autograd.grad((weights * logp).sum(), logits)
    want, = torch.autograd.grad((weights * want_logp).sum(), logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overwriting_the_logits_gives_the_same_gradient_and_refuses_a_second_backward(dtype):
    """``overwrite_logits``: the gradient lands in the logits' memory, bit-equal to a fresh tensor's."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(300, 16, generator=g).requires_grad_()
    head = torch.randn(1000, 16, generator=g).to(dtype)
    targets = torch.randint(1000, (300,), generator=g)
    grads = []
    for overwrite in (False, True):
        logits = h.to(dtype) @ head.t()  # (n, V) the head's output, as in policy_forward
        logp, _ = target_logprobs(logits, targets, 0.9, overwrite_logits=overwrite)
        h.grad = None
        logp.sum().backward(retain_graph=True)
        grads.append(h.grad.clone())
        if overwrite:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                logp.sum().backward()
    assert torch.equal(grads[0], grads[1])


def test_leaves_and_views_are_never_overwritten():
    """overwrite_logits applies only to a tensor autograd made that nothing else views."""
    leaf = torch.randn(6, 40, requires_grad=True)
    before = leaf.detach().clone()
    targets = torch.randint(40, (6,))
    target_logprobs(leaf, targets, overwrite_logits=True)[0].sum().backward()
    assert torch.equal(leaf.detach(), before)
    base = torch.randn(6, 80, requires_grad=True) * 1.0  # non-leaf; a slice of it is a view
    kept = base.detach().clone()
    target_logprobs(base[:, :40], targets, overwrite_logits=True)[0].sum().backward()
    assert torch.equal(base.detach(), kept)


def test_gradcheck_in_float64_across_small_blocks(monkeypatch):
    monkeypatch.setattr(target_module, "ROWS", 2)  # 5 rows: blocks of 2, 2 and 1
    logits, targets = case(n=5, V=7, dtype=torch.float64, scale=2.0)
    assert torch.autograd.gradcheck(lambda z: TargetLogProbs.apply(z, targets, 0.8, False)[0], (logits,))


def test_bf16_logits_get_a_bf16_gradient_within_bf16_rounding():
    logits, targets = case(n=200, V=5000, dtype=torch.bfloat16)
    logp, _ = target_logprobs(logits, targets, 1.0)
    want_logp, _ = reference(logits, targets, 1.0)  # fp32 of the same bf16 logits
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    got, = torch.autograd.grad(logp.sum(), logits)
    want, = torch.autograd.grad(want_logp.sum(), logits)  # fp32 gradient, cast back by autograd: bf16 too
    assert got.dtype == torch.bfloat16 == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3)


def test_extreme_logits_stay_finite():
    """A dominant logit (π ≈ 1) and a hopeless target (log π ≈ -1e4): no inf or nan anywhere."""
    logits = torch.zeros(2, 50)
    logits[0, 3], logits[1, 7] = 1e4, 1e4
    logits.requires_grad_()
    logp, entropy = target_logprobs(logits, torch.tensor([3, 0]), 1.0, with_entropy=True)
    assert logp[0].item() == 0.0 and logp[1].item() == pytest.approx(-1e4)
    assert entropy.abs().max() < 1e-6
    grad, = torch.autograd.grad(logp.sum(), logits)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("autocast", [False, True])
def test_policy_forward_gives_the_autograd_paths_logprobs_loss_and_gradients(tiny, autocast):
    """Speed never changes results, on the tiny model: the optimised path (target_logprobs) against autograd's log-softmax."""
    model, _ = tiny
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (4, 20), generator=g)  # (B, L)
    mask = torch.ones_like(ids)
    response = torch.zeros(4, 19)
    response[:, 8:] = 1
    advantages = torch.randn(4, 1, generator=g)

    def run(entropy_grad: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = policy_forward(model, ids, mask, response, temperature=0.9, with_entropy=True, entropy_grad=entropy_grad,
                                 chunk_size=16)  # several head chunks
            loss = -(advantages * out.logprobs * response).sum() / response.sum()
        loss.backward()
        return out, loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fused, fused_loss, fused_grads = run(entropy_grad=False)
    plain, plain_loss, plain_grads = run(entropy_grad=True)
    tol = dict(rtol=1e-5, atol=1e-5)  # under autocast too: both read the same bf16 logits, then work in fp32
    torch.testing.assert_close(fused.logprobs, plain.logprobs.detach(), **tol)
    torch.testing.assert_close(fused.entropy, plain.entropy.detach(), **tol)
    torch.testing.assert_close(fused_loss, plain_loss.detach(), **tol)
    assert fused_grads.keys() == plain_grads.keys() and fused_grads
    worst = 0.0
    for name, grad in plain_grads.items():
        scale = grad.abs().max().item() + 1e-12
        err = (fused_grads[name] - grad).abs().max().item() / scale
        worst = max(worst, err)
    assert worst < 1e-4  # measured ~3e-7 (fp32) and ~1e-6 (autocast): both paths start from the same logits


def test_the_cpu_block_buffers_are_kept_and_calls_do_not_disturb_each_other():
    """Forward and backward reuse one kept fp32 block per role; a second call (other sizes, entropy) between a
    forward and its backward changes neither result."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(300, 97, generator=g).requires_grad_()
    b = torch.randn(20, 131, generator=g).requires_grad_()
    targets_a, targets_b = torch.randint(0, 97, (300,), generator=g), torch.randint(0, 131, (20,), generator=g)
    expected = torch.autograd.grad(torch.log_softmax(a, -1).gather(1, targets_a[:, None]).sum(), a)[0]
    logp, _ = target_logprobs(a, targets_a)
    other, entropy = target_logprobs(b, targets_b, with_entropy=True)  # a wider vocabulary: the block grows
    torch.testing.assert_close(entropy, -(torch.softmax(b, -1) * torch.log_softmax(b, -1)).sum(-1).detach())
    (grad,) = torch.autograd.grad(logp.sum(), a)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    kept = target_module._KEPT[(torch.float32, "block")].buffer.data_ptr()
    target_logprobs(a, targets_a)
    target_logprobs(b, targets_b, with_entropy=True)
    assert target_module._KEPT[(torch.float32, "block")].buffer.data_ptr() == kept  # no new block once large enough


def test_a_first_call_under_inference_mode_does_not_poison_later_training_calls(monkeypatch):
    monkeypatch.setattr(target_module, "_KEPT", {})
    g = torch.Generator().manual_seed(6)
    logits, targets = torch.randn(10, 33, generator=g), torch.randint(0, 33, (10,), generator=g)
    with torch.inference_mode():
        target_logprobs(logits, targets)
    trained = logits.clone().requires_grad_()
    logp, _ = target_logprobs(trained, targets)
    logp.sum().backward()  # raised "Inplace update to inference tensor outside InferenceMode" with a kept inference block
    plain = logits.clone().requires_grad_()
    torch.log_softmax(plain, -1).gather(1, targets[:, None]).sum().backward()
    torch.testing.assert_close(trained.grad, plain.grad, rtol=1e-5, atol=1e-6)
