"""A group's shared prompt attended once: its keys and values kept per layer, and the attention of every row's own
new tokens over the shared prefix and over themselves (the fused decode step's grouped attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragen.models.kept_buffer import KeptBuffer


#: Decode steps the group-layout own-column buffers of :func:`_attend_grouped` grow by.
OWN_CHUNK = 32


#: Where :class:`FusedDecoder`'s prefix pages must grow, they grow to this multiple of the request
#: (:meth:`~ragen.models.kept_buffer.KeptBuffer.view`'s ``spare``): a multi-turn rollout's turns grow call by call.
PREFIX_PAGE_SPARE = 1.5


@dataclass
class SharedPrefix:
    """Rows ``[u·k, (u+1)·k)`` of a decode batch hold the same first ``length`` cache columns: prompt ``u``'s.

    For the ``U`` distinct prompts (as prefilled, before the rows were copied out to ``B = U·k``), in fp32:
    ``keys_t[i]`` holds layer ``i``'s keys transposed, ``(U, H_kv, D, W)`` (the layout the score GEMM reads
    fastest), the prefix in columns ``[0, length)``; ``values[i]`` is ``(U, H_kv, W, D)``; ``padding`` is
    ``(U, length)`` (True = a padding column) or None, and ``bias`` the same as an additive ``(U, 1, 1, length)``
    mask (-inf at padding, else 0). :func:`decode_step` then reads each prompt's keys and values once per
    group instead of once per row (``HFBackend._shared_prefill`` and ``_common_prefill`` record it). With
    ``capacity`` > 0 (the backend's growing caches are on) the rows' own columns are read per group too:
    :meth:`append_own` writes them after the prefix, in the same buffers (``W ≥ length``).
    """

    group: int
    length: int
    keys_t: list[torch.Tensor]
    values: list[torch.Tensor]
    padding: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    #: Most decode steps whose keys and values :func:`_attend_grouped` keeps in the group layout (0: none).
    capacity: int = 0
    #: Steps kept so far; None once a step went another way (the copies are then incomplete: not used again).
    own_steps: int | None = 0
    #: ``(U | 1, 1, k·g, length + capacity·k)``, made at the first grouped step: the prefix's padding (-inf) and,
    #: after it, 0 where query row ``j·g + h`` may read own column ``length + t·k + j`` (row ``j``'s), else -inf.
    grouped_bias: torch.Tensor | None = None
    #: Grouped steps computed by the C++ kernel (:mod:`ragen.models.native_decode`).
    native_steps: int = 0

    @classmethod
    def from_layers(cls, layers, group: int, padding: torch.Tensor | None, capacity: int = 0,
                    pages: list[KeptBuffer] | None = None) -> "SharedPrefix":
        """From the prefilled cache's layers (``U`` rows each); keys and values copied to fp32. ``capacity``: the
        most decode steps the call may take (room for :func:`_attend_grouped`'s copies; 0 keeps none). Groups of one
        get room for all of them at once (a row's own columns are few beside its prefix), larger groups the first
        :data:`OWN_CHUNK` steps. With ``pages`` (two :class:`KeptBuffer` a layer, kept by :class:`FusedDecoder` for a
        session) the copies go into memory an earlier call already faulted in: views valid until the next call that
        takes them (one ``generate`` call's prefix)."""
        U, H_kv, length, D = layers[0].keys.shape
        own = capacity if group == 1 else min(capacity, OWN_CHUNK)  # the first chunk of own columns, if any
        width = length + own * group
        if pages is not None:
            pages.extend(KeptBuffer() for _ in range(2 * len(layers) - len(pages)))
        keys_t, values = [], []
        for i, layer in enumerate(layers):
            Dv = layer.values.shape[-1]
            if pages is None:
                keys_t.append(layer.keys.new_empty(U, H_kv, D, width, dtype=torch.float32))
                values.append(layer.values.new_empty(U, H_kv, width, Dv, dtype=torch.float32))
            else:
                # room for more: a multi-turn rollout's next turns have longer caches
                keys_t.append(pages[2 * i].view((U, H_kv, D, width), torch.float32, spare=PREFIX_PAGE_SPARE))
                values.append(pages[2 * i + 1].view((U, H_kv, width, Dv), torch.float32, spare=PREFIX_PAGE_SPARE))
            keys_t[-1][..., :length] = layer.keys.transpose(-1, -2)  # to fp32
            values[-1][:, :, :length] = layer.values
        bias = None
        if padding is not None and bool(padding.any()):
            bias = torch.zeros(padding.shape[0], 1, 1, padding.shape[1]).masked_fill_(padding[:, None, None, :],
                                                                                       float("-inf"))
        else:
            padding = None
        return cls(group, length, keys_t, values, padding, bias, capacity=capacity)

    def append_own(self, layer: int, key: torch.Tensor, value: torch.Tensor, heads_per_kv: int):
        """Copy this step's ``key``/``value`` ``(B, H_kv, 1, D)`` into layer ``layer``'s buffers after the prefix
        (step-major: column ``length + t·k + j`` holds row ``j``'s step ``t``) and return the ``n = length + (t+1)·k``
        filled columns: ``(U, H_kv, D, n)`` keys, ``(U, H_kv, n, D)`` fp32 values and the ``(U | 1, 1, k·g, n)`` bias."""
        k, U, H_kv, D = self.group, key.shape[0] // self.group, key.shape[1], key.shape[-1]
        self.make_grouped_bias(heads_per_kv, key.device)
        n = self.reserve_own(layer)
        keys_t, values = self.keys_t[layer], self.values[layer]
        keys_t[..., n - k : n] = key.view(U, k, H_kv, D).permute(0, 2, 3, 1)  # (U, H_kv, D, k), to fp32
        values[:, :, n - k : n] = value.view(U, k, H_kv, -1).transpose(1, 2)  # (U, H_kv, k, D), to fp32
        return keys_t[..., :n], values[:, :, :n], self.grouped_bias[..., :n]

    def make_grouped_bias(self, heads_per_kv: int, device) -> torch.Tensor:
        """:attr:`grouped_bias`, made at the call's first grouped step (``heads_per_kv`` query heads per KV head)."""
        if self.grouped_bias is None:
            k, Lp, U = self.group, self.length, self.keys_t[0].shape[0]
            row = torch.arange(k, device=device).repeat_interleave(heads_per_kv)  # query row j·g + h -> j
            column = torch.arange(k, device=device).repeat(self.capacity)  # own column t·k + j -> j
            bias = torch.zeros(1 if self.bias is None else U, 1, k * heads_per_kv, Lp + self.capacity * k, device=device,
                               dtype=torch.float32)
            if self.bias is not None:
                bias[..., :Lp] = self.bias
            bias[..., Lp:].masked_fill_(row[:, None] != column[None, :], float("-inf"))
            self.grouped_bias = bias
        return self.grouped_bias

    def reserve_own(self, layer: int) -> int:
        """Make room in layer ``layer``'s buffers for this step's ``k`` own columns (grown by :data:`OWN_CHUNK` steps,
        not sized for ``capacity`` up front: rows may stop early); returns ``n = length + (t+1)·k``, the columns filled
        once they are written."""
        k, t, Lp = self.group, self.own_steps, self.length
        keys_t, values = self.keys_t[layer], self.values[layer]
        n = Lp + (t + 1) * k
        if keys_t.shape[-1] < n:
            U, H_kv, D = keys_t.shape[:3]
            width = Lp + min(self.capacity, t + OWN_CHUNK) * k
            grown_k = keys_t.new_empty(U, H_kv, D, width)
            grown_v = values.new_empty(U, H_kv, width, values.shape[-1])
            grown_k[..., : n - k] = keys_t[..., : n - k]
            grown_v[:, :, : n - k] = values[:, :, : n - k]
            self.keys_t[layer], self.values[layer] = grown_k, grown_v
        return n

    def grouped_step(self, past: int, padding: torch.Tensor | None) -> bool:
        """Whether this decode step (``past`` cached columns before it) can run :func:`_attend_grouped`: every earlier
        step since the prefix did, there is room, and no own column is padding."""
        if self.own_steps is None or self.own_steps >= self.capacity or past - self.length != self.own_steps:
            self.own_steps = None
            return False
        if padding is not None and bool(padding[..., self.length :].any()):
            self.own_steps = None
            return False
        return True


def _grouped_queries(query: torch.Tensor, k: int) -> torch.Tensor:
    """A group's queries together: ``(B, H_kv, g, D) -> (U, H_kv, k·g, D)``, row ``j·g + h`` = row ``j``'s head ``h``."""
    B, H_kv, g, D = query.shape
    return query.view(B // k, k, H_kv, g, D).transpose(1, 2).reshape(B // k, H_kv, k * g, D)


def _prefix_scores(query: torch.Tensor, prefix: SharedPrefix, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's scaled queries together, ``(B, H_kv, g, D) -> (U, H_kv, k·g, D)``, and their scores against the group's
    shared prefix, ``(U, H_kv, k·g, L_p)`` (padding columns -inf)."""
    grouped = _grouped_queries(query, prefix.group)
    shared = torch.matmul(grouped, prefix.keys_t[layer][..., : prefix.length])
    if prefix.bias is not None:
        shared.add_(prefix.bias)
    return grouped, shared


def _attend_shared(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, padding: torch.Tensor | None,
                   scaling: float, prefix: SharedPrefix, layer: int) -> torch.Tensor:
    """:func:`~ragen.models.decode_attention.grouped_one_query` with the first ``prefix.length`` columns read
    from the group's shared copy.

    One softmax over ``[shared prefix | the row's own columns]``: the prefix scores come from one GEMM per
    group with ``k·g`` query rows (``(U, H_kv, k·g, D) @ (U, H_kv, D, L_p)``), the rest from the row's own
    cache; the same sums as ``grouped_one_query``, split in two parts (the query is scaled before the
    products rather than the scores after them: the same up to fp32 rounding).
    """
    B, H_kv, g, D = query.shape
    k, Lp = prefix.group, prefix.length
    U = B // k
    query = query * scaling
    grouped, shared = _prefix_scores(query, prefix, layer)  # (U, H_kv, k·g, D), (U, H_kv, k·g, L_p)
    own = torch.matmul(query, keys[:, :, Lp:].float().transpose(-1, -2))  # (B, H_kv, g, L - L_p)
    if padding is not None:
        own.masked_fill_(padding[..., Lp:], float("-inf"))
    shared = shared.view(U, H_kv, k, g, Lp).transpose(1, 2).reshape(B, H_kv, g, Lp)
    probs = torch.softmax(torch.cat([shared, own], dim=-1), dim=-1)  # (B, H_kv, g, L)
    p_shared = probs[..., :Lp].reshape(U, k, H_kv, g, Lp).transpose(1, 2).reshape(U, H_kv, k * g, Lp)
    out = torch.matmul(p_shared, prefix.values[layer][:, :, :Lp])  # (U, H_kv, k·g, D)
    out = out.view(U, H_kv, k, g, -1).transpose(1, 2).reshape(B, H_kv, g, -1)
    return out + torch.matmul(probs[..., Lp:], values[:, :, Lp:].float())  # (B, H_kv, g, D)


def _attend_grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, prefix: SharedPrefix,
                    layer: int) -> torch.Tensor:
    """:func:`_attend_shared` with the rows' own columns also read per group: one softmax per group and KV head.

    The step's ``key``/``value`` ``(B, H_kv, 1, D)`` (also appended to the cache by the caller) are copied into
    ``prefix``'s buffers after the prompt's columns, step-major (column ``L_p + t·k + j`` holds row ``j``'s step
    ``t``). Then each group's ``k·g`` query rows meet ``[shared prefix | all k rows' own columns]`` in one score GEMM
    and one value GEMM of the group (``(U, H_kv, k·g, D) @ (U, H_kv, D, n)``, ``n = L_p + (t+1)·k``) instead of one
    tiny GEMM per row; ``grouped_bias`` (-inf) keeps each row to its own columns and off the prompt's padding. The
    same sums as :func:`_attend_shared` (a -inf score adds nothing), with far fewer, larger batched matrices.
    """
    B, H_kv, g, D = query.shape
    U, k = B // prefix.group, prefix.group
    keys_t, values, bias = prefix.append_own(layer, key, value, g)  # (U, H_kv, D, n), (U, H_kv, n, D), (U | 1, 1, k·g, n)
    grouped = _grouped_queries(query * scaling, k)  # (U, H_kv, k·g, D)
    probs = torch.softmax(torch.matmul(grouped, keys_t).add_(bias), dim=-1)  # (U, H_kv, k·g, n)
    out = torch.matmul(probs, values)  # (U, H_kv, k·g, D)
    return out.view(U, H_kv, k, g, -1).transpose(1, 2).reshape(B, H_kv, g, -1)  # (B, H_kv, g, D)
