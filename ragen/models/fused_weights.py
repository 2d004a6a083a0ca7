"""The decoder's weights as the fused decode step reads them: per layer, the attention and MLP projections stacked
and cast once per rollout (optionally MKL-packed), the norms and the LM head beside them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragen.models.kept_buffer import KeptBuffer
from ragen.models.packed_linear import PackedLinear, will_pack
from ragen.models.precision import intel_cpu


@dataclass
class _LayerWeights:
    qkv: PackedLinear  # (H·D + 2·H_kv·D, C): [W_q; W_k; W_v] and its bias, if any
    o: PackedLinear  # (C, H·D)
    gate_up: PackedLinear  # (2·I, C): [W_gate; W_up]
    down: PackedLinear  # (C, I)
    norm_in: torch.Tensor  # (C,) input_layernorm.weight, as stored
    norm_post: torch.Tensor  # (C,)
    eps_in: float
    eps_post: float


#: The fused step's GEMMs, by the names :class:`FusedWeights` packs them under.
PROJECTIONS = ("qkv", "o", "gate_up", "down", "head")
#: The fp32 GEMMs that ``pack=True`` packs for MKL at the decode batch (:meth:`PackedLinear.pack_rows`).
FP32_MKL_PROJECTIONS = frozenset({"qkv", "o", "gate_up"})
#: New tokens a call must be able to generate for packing the weights for MKL at its first decode step to pay: the
#: packing costs ~180 ms for SmolLM2 and saves ~12 ms a step at batch 32 (Cascade Lake Xeon, whole calls at
#: batch 32: 8 new tokens 0.97x, 16 1.02x, 24 1.17x, 32 1.09-1.16x; docs/performance.md). Steps of earlier calls
#: in the session do not count: they cannot gain from a pack built now.
MKL_PACK_MIN_STEPS = 24


def _stacked(tensors, dtype: torch.dtype, staging: KeptBuffer | None = None) -> torch.Tensor:
    """``torch.cat(tensors).to(dtype)`` in one pass: each part is cast while it is copied into its rows.

    With ``staging`` the result is a view of its buffer (overwritten by the next call: only for a copy that is
    packed right away); otherwise a new tensor."""
    shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
    out = staging.view(shape, dtype) if staging is not None else torch.empty(shape, dtype=dtype)
    row = 0
    for t in tensors:
        out[row : row + t.shape[0]].copy_(t.detach())
        row += t.shape[0]
    return out


class FusedWeights:
    """A model's decode weights, concatenated and cast to ``dtype`` once: a copy, valid while the parameters do not change.

    Nothing here can notice an optimizer step: torch's fused AdamW (ragen's default) writes parameters
    without bumping their version counters. The owner scopes the copy instead: :class:`FusedDecoder` is
    cleared by ``HFBackend`` when a rollout session ends and after a call outside a session.
    :meth:`current` only checks that the same parameter tensors (storage, dtype) are still in place.
    """

    def __init__(self, model, dtype: torch.dtype, pack: bool | frozenset[str] = True, staging: KeptBuffer | None = None,
                 mkl: frozenset[str] | None = None, panel: bool = False):
        self.dtype = dtype
        self.key = self._key(model)
        inner = model.model
        # pack=True packs what was measured to win (benchmarks/bench_decode.py): every bf16 projection
        # for oneDNN; in fp32 the LM head for oneDNN (its 49 152-row F.linear at 16-32 rows ran at a third of the packed
        # GEMM's speed on a Cascade Lake Xeon) and q/k/v, o and gate/up for MKL's packed GEMM at the decode batch
        # (1.08-1.27x per GEMM there against (W @ hᵀ)ᵀ on plain weights; down ran slower packed and stays plain)
        packed = (set(PROJECTIONS) if dtype == torch.bfloat16 else {"head"}) if pack is True else set(pack or ())
        if mkl is None:  # MKL's packed GEMM was measured to win on an Intel CPU, not on AMD (where MKL may pick other kernels)
            mkl = FP32_MKL_PROJECTIONS if pack is True and dtype == torch.float32 and intel_cpu() else frozenset()
        # with panel (fp32, pack=True, MKL not chosen: measured on an AMD CPU) the decoder's projections also keep a copy
        # for ragen's panel GEMM, which serves their decode-sized calls (PackedLinear, PANEL_MAX_ROWS)
        panels = (frozenset(PROJECTIONS) - {"head"} if panel and pack is True and dtype == torch.float32 and not mkl
                  else frozenset())
        cast = lambda w: w.detach().to(dtype) if w is not None else None  # noqa: E731 (a view when the dtype matches)

        def weight(name, *parts):  # a packed weight's cast goes through the staging buffer: the reorder copies it
            if name in packed and name not in mkl and will_pack(parts[0].device, dtype):  # PackedLinear keeps a packed copy
                if len(parts) == 1 and parts[0].dtype == dtype:
                    return parts[0].detach()  # already in the dtype: the reorder reads the parameter itself
                return _stacked(parts, dtype, staging)
            return _stacked(parts, dtype) if len(parts) > 1 else cast(parts[0])

        # unpacked, the head stays F.linear: row-major logits, as generate reads them
        linear = lambda name, w, b=None: PackedLinear(w, b, pack=name in packed, transposed=name != "head",  # noqa: E731
                                                      mkl=name in mkl, panel=name in panels)
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            biases = (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
            self.layers.append(_LayerWeights(
                qkv=linear("qkv", weight("qkv", a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                           _stacked(biases, dtype) if all(b is not None for b in biases) else None),
                o=linear("o", weight("o", a.o_proj.weight), cast(a.o_proj.bias)),
                gate_up=linear("gate_up", weight("gate_up", m.gate_proj.weight, m.up_proj.weight)),
                down=linear("down", weight("down", m.down_proj.weight)),
                norm_in=layer.input_layernorm.weight.detach(), norm_post=layer.post_attention_layernorm.weight.detach(),
                eps_in=layer.input_layernorm.variance_epsilon, eps_post=layer.post_attention_layernorm.variance_epsilon))
        self.norm = inner.norm.weight.detach()
        self.norm_eps = inner.norm.variance_epsilon
        self.head = linear("head", weight("head", model.lm_head.weight))  # (V, C)
        #: Whether MKL-backed linears wait for :meth:`pack_rows`.
        self.rows_pending = any(linear.mkl for linear in self.linears())
        #: Whether every projection and the head run on oneDNN-packed weights (what the C++ step takes).
        self.all_packed = all(linear.packed for linear in self.linears())

    def linears(self):
        """Every projection, layer by layer, then the head."""
        for w in self.layers:
            yield from (w.qkv, w.o, w.gate_up, w.down)
        yield self.head

    def pack_rows(self, rows: int) -> None:
        """Pack the MKL-backed linears for ``rows``-row calls (once; see :meth:`PackedLinear.pack_rows`)."""
        if self.rows_pending:
            self.rows_pending = False
            for linear in self.linears():
                linear.pack_rows(rows)

    @staticmethod
    def _key(model) -> tuple:
        return tuple((p.data_ptr(), p.dtype, p.shape) for p in model.parameters())

    def current(self, model, dtype: torch.dtype) -> bool:
        return dtype == self.dtype and self._key(model) == self.key
