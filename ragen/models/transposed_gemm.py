"""Linear layers as ``(W @ hᵀ)ᵀ`` while decoding on the CPU in fp32: the same outputs up to rounding, a faster GEMM layout.

``nn.Linear`` computes ``h @ Wᵀ``. With few rows -- decoding, where ``h`` holds one token per
sequence -- this CPU's fp32 GEMM (MKL, 2 threads) is faster when asked for ``(W @ hᵀ)ᵀ``:
the same products and sums in another BLAS layout, so the outputs equal ``F.linear``'s up to
float rounding (the BLAS may sum in another order: ~1e-6 relative; a bias is added in the same
``addmm``, as ``F.linear`` does). Greedy or sampled tokens can therefore differ from the plain
path's only where two logits tie to within that rounding. Measured (``benchmarks/bench_decode.py``,
``docs/performance.md``, 2 threads): SmolLM2's decode steps run 1.05-1.22× faster with every
linear switched at batch 16-64 (the LM head alone: 1.03-1.06×). Each GEMM alone, weights cycled
from memory, is a mixed picture: 0.86-1.14× for the decoder's shapes at 16-64 rows, 1.17-1.40×
for the 49 152 × 576 head, and 0.77-0.91× for every shape at 256 rows. :data:`MAX_ROWS` = 128
since the model's prefill over one prompt measured plain/transposed 1.02×, 1.06×, 0.99× and
0.89× at 64, 128, 192 and 256 tokens (``bench_decode.py --sections prefill``, 2 threads, idle;
the bound was 256 before, from a throwaway measurement).

Used only for plain ``torch.nn.Linear`` modules (exactly that class, with a plain-tensor weight:
LoRA wrappers, quantised or hooked-by-replacement linears keep their own ``forward``; the plain
base layer and A/B matrices inside a LoRA wrapper are switched, the small A/B shapes unmeasured),
fp32 weights on the CPU, no autocast. The model is
never changed permanently: :func:`transposed_linears` swaps the ``forward`` of each such module
for the duration of a ``with`` block (generation) and restores them even on error, so
training, ``save_pretrained`` and peft see the original modules.
"""

from __future__ import annotations

import contextlib

import torch

from ragen.models.lora import base_model

#: Most rows (tokens) a call may have to take the transposed layout; larger calls run ``F.linear``.
MAX_ROWS = 128


def output_head(model) -> torch.nn.Module | None:
    """The module that maps hidden states to logits (through a peft wrapper), or None."""
    base = base_model(model)
    get = getattr(base, "get_output_embeddings", None)
    return get() if get is not None else None


def transposable(module) -> bool:
    """True if ``module`` is a plain fp32 ``nn.Linear`` on the CPU, called outside autocast, with its class ``forward``."""
    return (
        type(module) is torch.nn.Linear
        and "forward" not in vars(module)  # accelerate-style hooks replace the instance's forward: leave those alone
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
        and type(module.weight.data) is torch.Tensor  # not a tensor subclass (quantised, sharded, ...)
        and not torch.is_autocast_enabled("cpu")
    )


def transposed_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      row_major: bool = True) -> torch.Tensor:
    """``F.linear(hidden, weight, bias)`` computed as ``(weight @ hiddenᵀ)ᵀ``; a ``(..., out)`` result.

    Differentiable (it is ``torch.mm`` and a transpose). ``hidden`` is ``(..., in)``. The result is copied to
    row-major unless ``row_major=False``: then a 2-D ``hidden`` gets the transposed view itself (strides
    ``(1, M)``), which the next GEMM reads without a copy (:mod:`ragen.models.fused_decode`).
    """
    x = hidden.reshape(-1, hidden.shape[-1])  # (M, in)
    out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())  # (out, M)
    out = out.t().contiguous() if row_major else out.t()  # callers of nn.Linear index row-wise: row-major
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def transposed_linears(model, enabled: bool = True):
    """Within the block, every :func:`transposable` linear of ``model`` runs :func:`transposed_linear`.

    Yields the switched modules (empty if none qualified or ``enabled`` is False). A call with
    more than :data:`MAX_ROWS` rows, non-fp32 input or autocast on runs ``nn.Linear.forward``.
    Forward hooks still run (``nn.Module.__call__`` calls them around ``forward``). The
    instance attributes are removed on exit, so the class's ``forward`` is back.
    """
    switched = [m for m in model.modules() if transposable(m)] if enabled else []

    def forward_of(linear: torch.nn.Linear):
        def forward(hidden: torch.Tensor) -> torch.Tensor:
            if hidden.dtype != torch.float32 or torch.is_autocast_enabled("cpu") or hidden.numel() > MAX_ROWS * hidden.shape[-1]:
                return torch.nn.Linear.forward(linear, hidden)
            return transposed_linear(hidden, linear.weight, linear.bias)

        return forward

    for linear in switched:
        linear.forward = forward_of(linear)
    try:
        yield switched
    finally:
        for linear in switched:
            del linear.forward
