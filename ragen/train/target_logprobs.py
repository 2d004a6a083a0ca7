"""Log-probability of each row's target token from LM-head logits, with a hand-written backward.

For logits ``z ∈ R^{n×V}`` (divided by the sampling temperature ``T``) and targets ``t``:

    log π(t_i) = z_{i,t_i}/T - lse_i,   lse_i = log Σ_v exp(z_{i,v}/T)                      (forward)
    ∂ log π(t_i) / ∂ z_{i,v} = (1[v = t_i] - π_v) / T,   π_v = exp(z_{i,v}/T - lse_i)       (backward)

and, when asked, the entropy ``H_i = lse_i - Σ_v π_v z_{i,v}/T`` as a metric (no gradient).

``log_softmax(z.float()).gather(t)`` computes the same thing, but in autograd's pieces: an fp32
copy of the ``(n, V)`` logits, the ``(n, V)`` log-softmax saved for the backward, and in the
backward a zero ``(n, V)`` tensor for ``gather``'s gradient, the log-softmax gradient and its bf16
cast -- five fresh ``(n, V)`` tensors per chunk (201 MB each in fp32 for 1 024 rows of SmolLM2's
49 152-token vocabulary), whose first touch costs a page fault per 4 KiB on the CPU. Here the only
``(n, V)`` tensor created is the gradient itself, in the logits' dtype (and not even that with
``overwrite_logits``, which stores it in the logits' memory); the fp32 work runs
:data:`ROWS` rows at a time in one reused buffer (kept between calls on the CPU), and the backward needs only the logits themselves
(saved here: ``(n, V)`` bf16 under autocast, half the fp32 log-softmax the plain path saves) and ``lse``
(``n`` floats). The backward is not itself differentiable (no double backward). Measured by ``benchmarks/bench_update.py``.
"""

from __future__ import annotations

import torch

from ragen.models.kept_buffer import KeptBuffer

#: Rows per fp32 block (a 128 × 49 152 fp32 block is 25 MB).
ROWS = 128

#: The CPU block buffers, kept between calls (by dtype and role): allocated afresh for every forward and backward,
#: a 25 MB block lands on pages the kernel faults in first (~19 ms a copy into it against ~4 warm, in the main job's
#: update). ragen runs its forward and backward passes on one thread, one at a time.
_KEPT: dict[tuple[torch.dtype, str], KeptBuffer] = {}


def _block_buffer(like: torch.Tensor, rows: int, dtype: torch.dtype, role: str) -> torch.Tensor:
    """A ``(rows, V)`` ``dtype`` buffer; on the CPU a view of one :class:`KeptBuffer` per ``role``."""
    V = like.shape[1]
    if like.device.type != "cpu" or torch.is_inference_mode_enabled():  # an inference tensor kept would refuse
        return like.new_empty((rows, V), dtype=dtype)                   # later in-place writes outside the mode
    return _KEPT.setdefault((dtype, role), KeptBuffer()).view((rows, V), dtype)


def _blocks(n: int):
    for start in range(0, n, ROWS):
        yield start, min(start + ROWS, n)


def _scaled_block(buffer: torch.Tensor, logits: torch.Tensor, start: int, end: int, temperature: float) -> torch.Tensor:
    z = buffer[: end - start]  # (k, V) compute dtype
    z.copy_(logits[start:end])
    if temperature != 1.0:
        z.div_(temperature)
    return z


class TargetLogProbs(torch.autograd.Function):
    """``(logits (n, V), targets (n,), T, with_entropy, overwrite) -> (log π(t) (n,), H (n,) or empty)``.

    See the module docstring; ``overwrite``: the backward writes the gradient into the logits' own
    storage instead of a new ``(n, V)`` tensor.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                overwrite: bool = False):
        n, V = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 (or fp64 for a gradcheck)
        buffer = _block_buffer(logits, min(ROWS, n), dtype, "block")
        spare = _block_buffer(logits, min(ROWS, n), dtype, "spare") if with_entropy else None
        lse = logits.new_empty(n, dtype=dtype)
        logp = logits.new_empty(n, dtype=dtype)
        entropy = logits.new_empty(n if with_entropy else 0, dtype=dtype)
        for start, end in _blocks(n):
            z = _scaled_block(buffer, logits, start, end, temperature)  # (k, V) z/T
            top = z.amax(-1, keepdim=True)  # (k, 1)
            z.sub_(top)  # (k, V) z' = z/T - max ≤ 0
            target = z.gather(1, targets[start:end, None]).squeeze(1)  # (k,) z'_t
            if with_entropy:
                e = torch.exp(z, out=spare[: end - start])  # (k, V) exp(z')
                mass = e.sum(-1)  # (k,) S
                weighted = torch.mul(e, z, out=z).sum(-1)  # (k,) Σ exp(z') z'
            else:
                mass = z.exp_().sum(-1)  # (k,) S = Σ exp(z')
            log_mass = mass.log()  # (k,)
            lse[start:end] = top.squeeze(1) + log_mass
            logp[start:end] = target - log_mass
            if with_entropy:
                entropy[start:end] = log_mass - weighted / mass  # H = log S - Σ π z'
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        # only a tensor autograd made and nothing else views (a leaf's data or a base tensor would change under the caller)
        ctx.overwrite = overwrite and not logits.is_leaf and logits._base is None and logits.is_contiguous()
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        T = ctx.temperature
        # (n, V) the logits' dtype (bf16 under autocast). Overwriting: each block is read into the fp32
        # buffer before its gradient is written back, and the write bumps the logits' version counter,
        # so a second backward through this node (retain_graph) raises instead of reading gradients.
        grad = logits.detach() if ctx.overwrite else torch.empty_like(logits)
        buffer = _block_buffer(logits, min(ROWS, logits.shape[0]), lse.dtype, "block")
        g = grad_logp.to(lse.dtype)
        for start, end in _blocks(logits.shape[0]):
            z = _scaled_block(buffer, logits, start, end, T)  # (k, V) z/T
            p = z.sub_(lse[start:end, None]).exp_()  # (k, V) π
            d = p.mul_(-g[start:end, None]).scatter_add_(1, targets[start:end, None], g[start:end, None])  # g(1[v=t] - π)
            if T != 1.0:
                d.div_(T)
            grad[start:end].copy_(d)
        return grad, None, None, None, None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, overwrite_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log π(t | z/T), H(π) or None)`` per row of ``logits`` ``(n, V)``; the log-probs carry gradients, the entropy none.

    ``overwrite_logits=True``: the backward stores the gradient in ``logits``' own memory (no fresh
    ``(n, V)`` tensor, whose first touch costs page faults); only for callers that never read
    ``logits`` after the backward (:func:`~ragen.train.logprobs.policy_forward`'s head chunks).
    """
    logp, entropy = TargetLogProbs.apply(logits, targets, float(temperature), bool(with_entropy), bool(overwrite_logits))
    return logp, entropy if with_entropy else None
