"""The LM head as ``W @ hᵀ`` on the CPU in fp32: the same logits, computed in a faster GEMM layout.

``nn.Linear`` computes ``h @ Wᵀ``. For a vocabulary-sized head on a few rows (SmolLM2:
``W`` is 49 152 × 576, ``h`` is 16–128 rows) the CPU's fp32 GEMM is faster when asked
for ``(W @ hᵀ)ᵀ`` instead (1.4–1.9× in the runs in
``benchmarks/bench_decode.py``, ``docs/performance.md``): the same products and sums, another BLAS layout. The decoder's own 576-wide linears
gain nothing from it, so only the head is changed.

Used only where it was measured to win: a plain ``torch.nn.Linear`` head (exactly that
class: LoRA-wrapped, quantised or hooked-by-replacement heads keep their own ``forward``),
fp32 weights on the CPU, no autocast. Otherwise :func:`fast_head_applies` is False and
callers take the plain path. The model object is never changed permanently:
:func:`transposed_lm_head` swaps the head's ``forward`` for the duration of a ``with``
block (generation), and restores it even on error, so training, ``save_pretrained`` and
peft see the original module.
"""

from __future__ import annotations

import contextlib

import torch


def output_head(model) -> torch.nn.Module | None:
    """The module that maps hidden states to logits (through a peft wrapper), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get = getattr(base, "get_output_embeddings", None)
    return get() if get is not None else None


def fast_head_applies(head) -> bool:
    """True if ``head`` is a plain fp32 ``nn.Linear`` on the CPU, called outside autocast, with its class ``forward``."""
    return (
        type(head) is torch.nn.Linear
        and "forward" not in vars(head)  # accelerate-style hooks replace the instance's forward: leave those alone
        and head.weight.device.type == "cpu"
        and head.weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
    )


def transposed_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(hidden, weight, bias)`` computed as ``(weight @ hiddenᵀ)ᵀ``; contiguous ``(..., out)`` result.

    Differentiable (it is ``torch.mm`` and a transpose). ``hidden`` is ``(..., in)``.
    """
    x = hidden.reshape(-1, hidden.shape[-1])  # (M, in)
    out = torch.mm(weight, x.t()).t().contiguous()  # (M, out): the logits callers index row-wise, so row-major
    if bias is not None:
        out = out + bias
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


def head_logits(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)``, through :func:`transposed_linear` when :func:`fast_head_applies` (else ``head`` itself)."""
    if fast_head_applies(head) and hidden.dtype == torch.float32:
        return transposed_linear(hidden, head.weight, head.bias)
    return head(hidden)


@contextlib.contextmanager
def transposed_lm_head(model, enabled: bool = True):
    """Within the block, ``model``'s LM head computes its logits with :func:`transposed_linear`.

    Yields True if the head was switched, False if it did not qualify (or ``enabled`` is
    False) and runs as before. Forward hooks on the head still run (``nn.Module.__call__``
    calls them around ``forward``). The instance attribute is removed on exit, so the class's
    ``forward`` is back.
    """
    head = output_head(model)
    if not enabled or head is None or not fast_head_applies(head):
        yield False
        return

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
            return torch.nn.Linear.forward(head, hidden)
        return transposed_linear(hidden, head.weight, head.bias)

    head.forward = forward
    try:
        yield True
    finally:
        del head.forward
