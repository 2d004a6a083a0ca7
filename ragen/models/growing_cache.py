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
shared-prompt prefill's row copy) copies the whole buffer, spare columns included, so the
rows keep their room. Views taken before a ``crop`` may see columns written after it (as
with any in-place cache such as ``StaticCache``). Used only for generation (no autograd
through in-place writes: with grad enabled it falls back to ``torch.cat``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` whose keys/values are views of over-allocated ``(B, heads, capacity, head_dim)`` buffers."""

    #: Columns added when a buffer is full and an ``update`` needs more (beyond what it needs).
    min_growth = 64

    def __init__(self):
        super().__init__()
        self._key_buffer = self._value_buffer = None

    @classmethod
    def from_tensors(cls, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> "GrowingLayer":
        """A layer holding ``keys``/``values`` (``(B, heads, n, d)``, copied) with room for ``capacity`` columns."""
        layer = cls()
        layer.lazy_initialization(keys, values)
        layer._adopt(keys, values, capacity)
        return layer

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        B, H, n, _ = keys.shape
        capacity = max(capacity, n)
        self._key_buffer = keys.new_empty(B, H, capacity, keys.shape[-1])
        self._value_buffer = values.new_empty(B, values.shape[1], capacity, values.shape[-1])
        self._key_buffer[:, :, :n] = keys
        self._value_buffer[:, :, :n] = values
        self.keys, self.values = self._key_buffer[:, :, :n], self._value_buffer[:, :, :n]

    def _owns_views(self) -> bool:
        """True if ``keys``/``values`` are still the ``[:, :, :n]`` views of this layer's buffers."""
        kb, vb = self._key_buffer, self._value_buffer
        return (
            kb is not None
            and self.keys is not None
            and self.values is not None
            and self.keys.data_ptr() == kb.data_ptr()
            and self.values.data_ptr() == vb.data_ptr()
            and self.keys.shape[:2] == kb.shape[:2]
            and self.keys.stride() == kb.stride()
            and self.values.stride() == vb.stride()
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            self._key_buffer = self._value_buffer = None
            return super().update(key_states, value_states, *args, **kwargs)  # torch.cat: differentiable
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        add = key_states.shape[-2]
        n = self.reserve(add, key_states, value_states)
        self._key_buffer[:, :, n : n + add] = key_states
        self._value_buffer[:, :, n : n + add] = value_states
        return self.advance(add)

    def reserve(self, add: int, key_states: torch.Tensor | None = None, value_states: torch.Tensor | None = None) -> int:
        """Make room for ``add`` more columns (copying into a fresh buffer if the views are not the buffer's own or it is
        full) and return ``n``, the filled columns: the new ones go to ``buffer[:, :, n : n + add]``, then
        :meth:`advance`. An empty layer takes its buffers' shape and dtype from ``key_states``/``value_states``."""
        n = self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0
        if not self._owns_views() or n + add > self._key_buffer.shape[-2]:
            if n == 0:
                keys, values = key_states[:, :, :0], value_states[:, :, :0]
            else:
                keys, values = self.keys, self.values
            self._adopt(keys, values, n + add + max(self.min_growth, n // 2))
        return n

    def advance(self, add: int):
        """Extend ``keys``/``values`` over ``add`` columns written into the buffers after the filled ones."""
        n = self.keys.shape[-2] + add
        self.keys, self.values = self._key_buffer[:, :, :n], self._value_buffer[:, :, :n]
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows ``beam_idx`` of the cache (``(U, ...) -> (len(beam_idx), ...)``), spare columns included."""
        if not self._owns_views():
            return super().reorder_cache(beam_idx)
        n = self.keys.shape[-2]
        index = beam_idx.to(self._key_buffer.device)
        self._key_buffer = self._key_buffer.index_select(0, index)
        self._value_buffer = self._value_buffer.index_select(0, index)
        self.keys, self.values = self._key_buffer[:, :, :n], self._value_buffer[:, :, :n]

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


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
