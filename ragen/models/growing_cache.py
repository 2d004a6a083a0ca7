"""A KV-cache layer that grows in place: decode steps write into spare columns instead of ``torch.cat``.

``DynamicLayer.update`` concatenates a layer's whole key and value tensors with the new
token's every decode step, so step ``t`` copies ``t`` columns of every layer's cache. On this
project's 2-core CPU that was ~20 % of a decode step at batch 32 (``docs/performance.md``).
:class:`GrowingLayer` keeps its keys and values in buffers with room for the tokens still to
come; ``keys``/``values`` are views of the filled columns (``[:, :, :n]``) and ``update``
writes the new columns into the buffer. Attention reads the views (strided, not contiguous).

Anything that replaces ``keys``/``values`` with another tensor (``batch_select_indices``,
``offload``, …) simply makes the next ``update`` copy them into a fresh buffer;
``crop`` keeps the buffer (its view still starts at column 0). ``reorder_cache`` (the
shared-prompt prefill's row copy, ``(U, ...) -> (B, ...)``) allocates the ``B``-row buffers
with the same room but defers the copy of the filled columns: they are copied from the
``U``-row source the first time anything reads ``keys``/``values``. A decode step that
reads the shared prompt's columns from elsewhere (the grouped step of
:mod:`ragen.models.fused_decode`, which keeps them once per prompt) appends through
:meth:`GrowingLayer.write` and never pays for the copy: ~150 MB of fresh pages at batch 32,
never read; deferring it made whole batch-32 generate calls 1.037× faster on this project's
CPU (alternated A/B, ``benchmarks/bench_decode.py --sections native``). A multi-turn
rollout that keeps the rows' caches for the next turn still pays for it, when
``HFBackend._keep`` reads them. Views taken before a ``crop`` may see columns written after
it (as with any in-place cache such as ``StaticCache``). Used only for generation (no
autograd through in-place writes: with grad enabled it falls back to ``torch.cat``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` whose keys/values are views of over-allocated ``(B, heads, capacity, head_dim)`` buffers."""

    #: Columns added when a buffer is full and an ``update`` needs more (beyond what it needs).
    min_growth = 64

    _keys: torch.Tensor | None = None
    _values: torch.Tensor | None = None
    #: A row copy :meth:`reorder_cache` deferred: ``(source keys buffer, source values buffer, index (B,), columns)``;
    #: buffer rows ``b`` hold nothing yet in columns ``[0, columns)``: they are the source's rows ``index[b]``.
    _pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    def __init__(self):
        super().__init__()
        self._key_buffer = self._value_buffer = None

    @property
    def keys(self) -> torch.Tensor | None:
        """The filled columns' keys ``(B, H_kv, n, D)`` (a view of the buffer), copying a deferred row copy first."""
        self._materialize()
        return self._keys

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._pending = None  # replaced from outside: the buffer's deferred columns no longer matter
        self._keys = tensor

    @property
    def values(self) -> torch.Tensor | None:
        """The filled columns' values ``(B, H_kv, n, D)``, as :attr:`keys`."""
        self._materialize()
        return self._values

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._pending = None
        self._values = tensor

    def _materialize(self) -> None:
        """Do the row copy :meth:`reorder_cache` deferred (columns ``[0, n0)`` of every row, from the source rows)."""
        if self._pending is None:
            return
        source_k, source_v, index, n0 = self._pending
        for row, source in enumerate(index.tolist()):  # row by row: no (B, H_kv, n0, D) temporary
            self._key_buffer[row, :, :n0].copy_(source_k[source, :, :n0])
            self._value_buffer[row, :, :n0].copy_(source_v[source, :, :n0])
        self._pending = None  # only once every row is copied: an interrupted copy is redone, not left half done

    def filled_views(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(keys, values)`` as they are, without doing a deferred row copy: shapes, dtypes and the buffer's new
        columns are right, but the filled columns may not hold the rows' prefix yet. For code that reads those columns
        elsewhere (a decode step with the shared prompt kept apart) or only looks at shapes."""
        return self._keys, self._values

    @property
    def deferred(self) -> bool:
        """Whether a row copy is still deferred (no one has read the filled columns since :meth:`reorder_cache`)."""
        return self._pending is not None

    def get_seq_length(self) -> int:
        keys = self._keys
        if not self.is_initialized or keys is None or keys.numel() == 0:
            return 0
        return keys.shape[-2]

    @classmethod
    def from_tensors(cls, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> "GrowingLayer":
        """A layer holding ``keys``/``values`` (``(B, heads, n, d)``, copied) with room for ``capacity`` columns."""
        layer = cls()
        layer.lazy_initialization(keys, values)
        layer._adopt(keys, values, capacity)
        return layer

    @classmethod
    def allocate(cls, key_like: torch.Tensor, value_like: torch.Tensor, rows: int, filled: int,
                 capacity: int) -> "GrowingLayer":
        """A layer of ``rows`` rows whose first ``filled`` columns the caller writes (:meth:`filled_views`) and room for
        ``capacity`` columns in all: buffers ``(rows, heads, capacity, d)`` of ``key_like``/``value_like``'s heads, head
        size, dtype and device (``(heads, ·, d)`` tensors), left uninitialised. Spares one copy where a cache is
        assembled row by row (a resumed turn's kept prefixes) and would otherwise be copied again into a growing buffer."""
        layer = cls()
        keys = key_like.new_empty(rows, key_like.shape[0], max(capacity, filled), key_like.shape[-1])
        values = value_like.new_empty(rows, value_like.shape[0], max(capacity, filled), value_like.shape[-1])
        layer.lazy_initialization(keys, values)
        layer._key_buffer, layer._value_buffer = keys, values
        layer.keys, layer.values = keys[:, :, :filled], values[:, :, :filled]
        return layer

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        B, H, n, _ = keys.shape
        capacity = max(capacity, n)
        self._key_buffer = keys.new_empty(B, H, capacity, keys.shape[-1])
        self._value_buffer = values.new_empty(B, values.shape[1], capacity, values.shape[-1])
        self._key_buffer[:, :, :n] = keys
        self._value_buffer[:, :, :n] = values
        self.keys, self.values = self._key_buffer[:, :, :n], self._value_buffer[:, :, :n]  # clears _pending

    def _owns_views(self) -> bool:
        """True if ``keys``/``values`` are still the ``[:, :, :n]`` views of this layer's buffers."""
        kb, vb, keys, values = self._key_buffer, self._value_buffer, self._keys, self._values
        return (
            kb is not None
            and keys is not None
            and values is not None
            and keys.data_ptr() == kb.data_ptr()
            and values.data_ptr() == vb.data_ptr()
            and keys.shape[:2] == kb.shape[:2]
            and keys.stride() == kb.stride()
            and values.stride() == vb.stride()
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            self._materialize()  # a deferred row copy reads the buffers dropped next
            self._key_buffer = self._value_buffer = None
            return super().update(key_states, value_states, *args, **kwargs)  # torch.cat: differentiable
        self.write(key_states, value_states)
        return self.keys, self.values

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """:meth:`update` without returning (or reading) the filled columns: a deferred row copy stays deferred."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        add = key_states.shape[-2]
        n = self.reserve(add, key_states, value_states)
        self._key_buffer[:, :, n : n + add] = key_states
        self._value_buffer[:, :, n : n + add] = value_states
        self.advance(add)

    def reserve(self, add: int, key_states: torch.Tensor | None = None, value_states: torch.Tensor | None = None) -> int:
        """Make room for ``add`` more columns (copying into a fresh buffer if the views are not the buffer's own or it is
        full) and return ``n``, the filled columns: the new ones go to ``buffer[:, :, n : n + add]``, then
        :meth:`advance`. An empty layer takes its buffers' shape and dtype from ``key_states``/``value_states``."""
        n = self._keys.shape[-2] if self._keys is not None and self._keys.dim() == 4 else 0
        if not self._owns_views() or n + add > self._key_buffer.shape[-2]:
            if n == 0:
                keys, values = key_states[:, :, :0], value_states[:, :, :0]
            else:
                keys, values = self.keys, self.values  # a deferred row copy is done first
            self._adopt(keys, values, n + add + max(self.min_growth, n // 2))
        return n

    def advance(self, add: int) -> None:
        """Extend ``keys``/``values`` over ``add`` columns written into the buffers after the filled ones (a deferred
        row copy, which covers columns before those, stays deferred)."""
        n = self._keys.shape[-2] + add
        self._keys, self._values = self._key_buffer[:, :, :n], self._value_buffer[:, :, :n]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows ``beam_idx`` of the cache (``(U, ...) -> (len(beam_idx), ...)``) in fresh buffers with the same room;
        the filled columns' copy is deferred until they are read (:attr:`keys`)."""
        if not self._owns_views():
            return super().reorder_cache(beam_idx)
        n = self._keys.shape[-2]
        index = beam_idx.to(self._key_buffer.device)
        pending = self._pending
        if pending is not None and pending[3] == n:  # nothing written since the last reorder: compose the two
            source_k, source_v, index = pending[0], pending[1], pending[2][index]
        else:
            self._materialize()  # columns written since then belong to these buffers' rows
            source_k, source_v = self._key_buffer, self._value_buffer
        B = index.shape[0]
        self._key_buffer = source_k.new_empty(B, *self._key_buffer.shape[1:])
        self._value_buffer = source_v.new_empty(B, *self._value_buffer.shape[1:])
        self._keys, self._values = self._key_buffer[:, :, :n], self._value_buffer[:, :, :n]
        self._pending = (source_k, source_v, index, n) if n > 0 else None

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()  # sets keys/values to None: drops a deferred copy


def plain_layers(cache) -> bool:
    """Whether ``cache`` is made of exactly ``DynamicLayer``s or :class:`GrowingLayer`s (one per decoder layer), the
    layers ragen's prefill and decode paths append to and re-lay out. Subclasses (sliding-window, quantised, ...)
    keep other columns and do not count."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in (DynamicLayer, GrowingLayer) for layer in layers)


def make_growing(cache, capacity: int):
    """Turn ``cache``'s filled ``DynamicLayer``s into :class:`GrowingLayer`s with room for ``capacity`` columns.

    Returns ``cache`` (changed in place). Layers of other types (sliding window, quantised, …)
    and empty layers are left as they are, so any cache is safe to pass.
    """
    layers = getattr(cache, "layers", None)
    if not layers:
        return cache
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:
            layers[i] = GrowingLayer.from_tensors(layer.keys, layer.values, capacity)
    return cache
