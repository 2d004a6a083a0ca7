"""Linear layers on weights reordered once into oneDNN's blocked layout: ``x Wᵀ + b`` without a per-call weight reorder.

A CPU GEMM kernel reads its weight matrix in a blocked ("packed") layout. ``F.linear`` on a plain
row-major weight lets the BLAS pack it again at every call; during decoding, where a call brings
only one token per row, that repacking is a large share of each projection. oneDNN (torch's
``mkldnn`` backend) can pack a weight once (``torch.ops.mkldnn._reorder_linear_weight``, the op
torch's inductor uses when it freezes a model's weights for CPU inference) and then run
``_linear_pointwise`` on it for any number of rows.

The products and sums are those of ``F.linear`` in the same dtype: in fp32 and in bf16 (fp32
accumulation) the outputs were bitwise equal to ``F.linear``'s at 1 to 700 rows on this machine
(``tests/models/test_packed_linear.py`` checks agreement to float rounding, since another CPU's
kernels may sum in another order). Measured on the 2-core EPYC (bf16, ``benchmarks/bench_decode.py``): SmolLM2's projections at 32 rows 1.1-1.2× faster than ``(W @ xᵀ)ᵀ`` and
1.4-2.0× faster than ``F.linear``; the 49 152 × 576 LM head 1.8× faster than ``F.linear``.

In fp32, MKL's own packed GEMM (``cblas_sgemm_pack``/``_compute`` through ``torch.ops.mkl._mkl_linear``,
what inductor freezes fp32 CPU weights into) is the faster kernel for SmolLM2's q/k/v, o and gate/up
projections at decode batches on a Cascade Lake Xeon (1.08-1.27x per GEMM against ``(W @ hᵀ)ᵀ`` at 32 rows,
whole ``generate`` calls of 32 new tokens at batch 32 1.085-1.16x; ``docs/performance.md``). Torch packs it for one row count
(:meth:`PackedLinear.pack_rows`, the decode batch) and runs ``F.linear`` for any other, so a linear packed
for MKL keeps its plain weight for the other calls. Its outputs equalled ``F.linear``'s bit for bit at the
packed row count there.

In fp32 on an AVX2 CPU ragen's own panel GEMM (``ragen/models/csrc/panel_gemm.cpp``, :data:`ragen.models.native.GEMM`)
serves calls of up to :data:`PANEL_MAX_ROWS` rows on a copy of the weight packed into 16-column panels: on the
2-core AVX2 EPYC the decoder's projections ran 1.2-1.9x faster than ``(W @ hᵀ)ᵀ`` and oneDNN's packed GEMM at 8-16
rows, 0.96-1.35x at 32 (whole calls at batch 32 0.95x), and slower from 48 rows (``bench_decode.py --sections
panel``, docs/performance.md); larger calls keep the plain weight's path. Sums run in another order than the BLAS's: outputs agree to float rounding.

A packed weight is a copy: it does not follow later changes to the parameter. Owners scope it
(:class:`~ragen.models.fused_decode.FusedDecoder` keeps it for one rollout session).
Where torch has no oneDNN (or it refuses the dtype), :class:`PackedLinear` keeps the plain weight and
computes :func:`~ragen.models.transposed_gemm.transposed_linear` instead.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import ragen.models.native as native
from ragen.models.transposed_gemm import MAX_ROWS, transposed_linear

#: Row count oneDNN is told to expect when packing (measured: the layout it picks ran equally fast at 1-700 rows).
_BATCH_HINT = 64
#: Most rows a call may have to run on the panel GEMM (measured: faster at 8-16 rows, mixed at 32, slower from 48;
#: whole ``generate`` calls at batch 16 1.11x, at batch 32 0.95x with a bound of 32).
PANEL_MAX_ROWS = 16


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build packs and runs ``dtype`` CPU linears with oneDNN (tried once on a small weight)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.ones(8, 16, dtype=dtype), torch.ones(2, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return out.shape == (2, 8) and out.dtype == dtype and bool((out == 16).all())
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@functools.cache
def mkl_packing_available() -> bool:
    """Whether this torch build packs fp32 weights for MKL's packed GEMM (``cblas_sgemm_pack``; tried once)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        weight, x = torch.ones(8, 16), torch.ones(2, 16)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 2)
        out = torch.ops.mkl._mkl_linear(x, packed, weight, None, 2)
        return out.shape == (2, 8) and bool((out == 16).all())
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def will_pack(device: torch.device, dtype: torch.dtype, pack: bool = True) -> bool:
    """Whether :class:`PackedLinear` packs a weight on ``device`` in ``dtype`` (then it keeps a packed copy, not the
    tensor it was given)."""
    return pack and device.type == "cpu" and packing_available(dtype)


class PackedLinear:
    """``x @ weightᵀ + bias`` for ``x`` of shape ``(..., in)`` on a weight packed once (a copy; see the module doc).

    ``weight`` ``(out, in)`` and ``bias`` ``(out,)`` should already be in the compute dtype; ``x`` must be in it too.
    Without oneDNN for that dtype (or ``pack=False``) the weight stays as given and calls run
    :func:`~ragen.models.transposed_gemm.transposed_linear` (up to :data:`~ragen.models.transposed_gemm.MAX_ROWS`
    rows, unless ``transposed=False``; its result is a transposed view) or ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True, transposed: bool = True,
                 mkl: bool = False, panel: bool = False):
        weight = weight.detach()
        self.transposed = transposed
        self.out_features, self.in_features = weight.shape
        self.bias = bias.detach() if bias is not None else None
        #: With ``mkl`` (fp32 on the CPU, MKL present) the weight stays plain and :meth:`pack_rows` adds MKL's packed copy.
        self.mkl = mkl and weight.dtype == torch.float32 and weight.device.type == "cpu" and mkl_packing_available()
        self.packed = not self.mkl and will_pack(weight.device, weight.dtype, pack)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _BATCH_HINT) if self.packed else weight
        self.mkl_weight: torch.Tensor | None = None  # MKL's packed copy, for calls of exactly mkl_rows rows
        self.mkl_rows: int | None = None
        #: With ``panel`` (fp32 on the CPU) the weight stays plain for larger calls, and the first call of up to
        #: PANEL_MAX_ROWS rows loads the panel GEMM (:func:`ragen.models.native.gemm_ops`: built on its first use on a
        #: machine, ~30 s) and packs :attr:`panels` ``(⌈out/16⌉, in, 16)`` (SmolLM2's decoder: ~0.27 s), so only
        #: sessions with such calls pay either. False once the library proved unavailable.
        self.panel = (panel and not self.packed and not self.mkl and weight.dtype == torch.float32
                      and weight.device.type == "cpu")
        self.panels: torch.Tensor | None = None
        self._gemm = None

    def pack_rows(self, rows: int) -> None:
        """With ``mkl``, pack the weight once for MKL's GEMM at ``rows`` rows (the decode batch); later calls of other
        row counts keep the plain weight's path (torch's op falls back to ``F.linear`` there, slower for few rows)."""
        if self.mkl and self.mkl_rows is None:
            self.mkl_weight = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.contiguous(), rows)
            self.mkl_rows = rows

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            flat = x.reshape(-1, self.in_features)  # (M, in)
            out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")  # (M, out) row-major
            return out.view(*x.shape[:-1], self.out_features)
        if self.panel and x.dim() == 2 and x.shape[0] <= PANEL_MAX_ROWS and x.dtype == torch.float32:
            if self.panels is None:
                self._gemm = native.gemm_ops()
                self.panel = self._gemm is not None
                if self.panel:
                    self.panels = self._gemm.pack_panels(self.weight)
            if self.panel:
                return self._gemm.linear_panels(x, self.panels, self.out_features, self.bias)  # (M, out) row-major
        if self.mkl_rows is not None and x.dim() == 2 and x.shape[0] == self.mkl_rows:
            return torch.ops.mkl._mkl_linear(x, self.mkl_weight, self.weight, self.bias, self.mkl_rows)  # (M, out)
        if self.transposed and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
            return transposed_linear(x, self.weight, self.bias, row_major=False)  # (M, out), strides (1, M)
        return F.linear(x, self.weight, self.bias)
