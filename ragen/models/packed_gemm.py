"""Linear layers on weights pre-packed for oneDNN while generating under bf16 autocast on the CPU.

Under autocast, ``nn.Linear`` hands oneDNN a bf16 copy of the weight in PyTorch's row-major
layout, and oneDNN reorders it into its blocked GEMM layout on *every* call. At decode time a
call has a few rows (one token per sequence), so that per-call reorder is a large share of
each GEMM. :class:`PackedLinears` does the reorder once per rollout
(``torch.ops.mkldnn._reorder_linear_weight`` on the bf16 cast, as inductor's CPU freezing
pass does) and calls ``torch.ops.mkldnn._linear_pointwise`` on the packed weight: the same
bf16 inputs, the same oneDNN kernel, so the outputs equal autocast's ``F.linear`` (a
microbenchmark of SmolLM2's shapes at 16 rows: maximum difference 0.0; ``docs/performance.md``,
"Packed bf16 weights").

Packing costs about what autocast's own bf16 cast of the weights costs, so the packs are kept
for as long as the weights cannot change: inside :meth:`PackedLinears.session` (one
``Rollout.run``, through ``HFBackend.session``: every turn of a multi-turn rollout decodes on
the same packs) and otherwise for one ``generate`` call. They are dropped when the session or
call ends, so the next rollout, after an optimizer step or weight sync, packs the new weights.
(Weight version counters cannot stand in for this: ``torch.optim.AdamW(fused=True)`` updates
parameters in place without bumping them; ``tests/models/test_packed_gemm.py`` checks the
scoping.) Memory: a bf16 copy of the linears' weights (~270 MB for 135 M parameters) while
a rollout runs.

Used only for plain ``torch.nn.Linear`` modules (exactly that class, class ``forward``, plain
fp32 or bf16 weight tensor on the CPU), only inside ``torch.no_grad`` with bf16 CPU autocast on,
and only where this torch build has oneDNN with bf16 support. Anything else runs
``nn.Linear.forward``. Like :mod:`ragen.models.transposed_gemm`, the model is never changed
permanently: the ``forward`` swap lasts for a ``with`` block.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

#: The row count the packed layout is chosen for (decode steps: one row per sequence).
PACK_ROWS_HINT = 16


def supported() -> bool:
    """True if this torch build can run oneDNN bf16 linears on packed weights on this CPU."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
        and bool(mkldnn._is_mkldnn_bf16_supported())
    )


def _bf16_autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def packable(module) -> bool:
    """True if ``module`` is a plain fp32/bf16 ``nn.Linear`` on the CPU with its class ``forward``."""
    return (
        type(module) is torch.nn.Linear
        and "forward" not in vars(module)  # hooked-by-replacement linears keep their own forward
        and module.weight.device.type == "cpu"
        and module.weight.dtype in (torch.float32, torch.bfloat16)
        and type(module.weight.data) is torch.Tensor  # not a tensor subclass (quantised, sharded, ...)
    )


class PackedLinears:
    """A model's packed bf16 weights, kept for one generation call or one :meth:`session`."""

    def __init__(self) -> None:
        # id(module) -> (packed weight, bf16 bias or None, weakref to the weight it was packed from)
        self._packs: dict[int, tuple] = {}
        self._in_session = False
        #: How many weights were packed in total: a test and benchmark counter.
        self.packed_count = 0

    def clear(self) -> None:
        self._packs.clear()

    @contextlib.contextmanager
    def session(self) -> Iterator["PackedLinears"]:
        """Keep packs between generation calls inside this block; the caller promises the weights
        do not change in it (one rollout). Dropped at exit, even on error."""
        if self._in_session:
            raise RuntimeError("PackedLinears.session() does not nest: the inner one would drop the outer one's packs")
        self.clear()
        self._in_session = True
        try:
            yield self
        finally:
            self._in_session = False
            self.clear()

    def _pack(self, linear: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        entry = self._packs.get(id(linear))
        if entry is None or entry[2]() is not linear.weight:
            with torch.no_grad():
                weight = linear.weight.detach().to(torch.bfloat16)  # (out, in): autocast's own cast
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
                bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
            entry = (packed, bias, weakref.ref(linear.weight))
            self._packs[id(linear)] = entry
            self.packed_count += 1
        return entry[0], entry[1]

    @contextlib.contextmanager
    def active(self, model, enabled: bool = True) -> Iterator[list[torch.nn.Module]]:
        """Within the block, every :func:`packable` linear of ``model`` runs on its packed weight
        (if bf16 CPU autocast is on and gradients are off at entry; else nothing is switched).

        Yields the switched modules. Weights must not change inside the block (they do not while
        generating). Outside a :meth:`session` the packs are dropped at exit. Forward hooks still run.
        """
        on = enabled and _bf16_autocast_on() and not torch.is_grad_enabled() and supported()
        if not self._in_session:
            self.clear()  # packs never outlive a call outside a session, even one that failed midway
        switched = [m for m in model.modules() if packable(m)] if on else []
        packs = {id(m): self._pack(m) for m in switched}

        def forward_of(linear: torch.nn.Linear):
            packed, bias = packs[id(linear)]
            out_features = linear.out_features

            def forward(hidden: torch.Tensor) -> torch.Tensor:
                if torch.is_grad_enabled() or not _bf16_autocast_on() or hidden.device.type != "cpu":
                    return torch.nn.Linear.forward(linear, hidden)
                x = hidden.reshape(-1, hidden.shape[-1]).to(torch.bfloat16)  # (M, in)
                out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # (M, out) bf16
                return out.reshape(*hidden.shape[:-1], out_features)

            return forward

        for linear in switched:
            linear.forward = forward_of(linear)
        try:
            yield switched
        finally:
            for linear in switched:
                del linear.forward
            if not self._in_session:
                self.clear()


__all__ = ["PACK_ROWS_HINT", "PackedLinears", "packable", "supported"]
