"""The tied embedding / LM-head weight's gradient, accumulated in kept memory (CPU updates).

Many small models (SmolLM2, Qwen2.5-0.5B, Llama 3.2 1B) tie the input embedding and the LM head to
one ``(V, H)`` weight ``W``. Its gradient is the sum of the head's and the lookup's parts:

    ∂L/∂W = Σ_i g_iᵀ h_i  +  Σ_t e_{x_t} (∂L/∂emb_t)ᵀ        (head: g_i = ∂L/∂logits_i; lookup: token x_t's row)

Under bf16 autocast autograd builds it from five ``(V, H)`` tensors per micro-batch: the head's bf16
cast of ``W`` (56 MB for SmolLM2), the head's bf16 weight gradient (56 MB), its fp32 cast (113 MB),
the lookup's dense gradient (``embedding_dense_backward``: 113 MB of zeros with a few rows written)
and the sum of the two parts (113 MB). Each is larger than glibc's mmap ceiling (32 MB), so each is a
fresh ``mmap`` whose pages the kernel faults in and zero-fills 4 KiB at a time -- ~110 k page faults
per micro-batch, whose cost on a VM varies with the host (``docs/performance.md``).

:class:`TiedWeight` keeps that memory instead, between micro-batches and optimizer steps:

- the head multiplies by a compute-dtype copy of ``W`` kept in one buffer, refreshed (copied in
  place) at every forward, so it always equals what autocast's cast would be;
- the head's backward computes ``gᵀh`` in blocks of :data:`ROWS` vocabulary rows into one kept
  compute-dtype buffer (``mm(out=)``, the GEMM autocast's ``linear`` backward runs, one slice at a
  time: bit-equal) and adds each into ``W.grad`` in place. Whole, oneDNN's bf16 GEMM also makes a
  fresh fp32 ``(V, H)`` result (113 MB) before rounding it: 49.5 ms for 149 rows of SmolLM2, against
  15.5 ms in blocks of 4 096 (``benchmarks/bench_update.py``);
- the lookup's backward adds each token's gradient row into ``W.grad`` (``index_add_``), skipping
  ``padding_idx`` as ``nn.Embedding`` does;
- ``W.grad``, when ``None`` (after ``zero_grad(set_to_none=True)``), becomes one kept fp32 buffer,
  zeroed in place. A caller that holds on to an earlier step's ``W.grad`` therefore sees it reused.

The gradient goes into ``W.grad`` by side effect, as ``loss.backward()`` does, which is how ragen's trainers use
it; ``torch.autograd.grad(loss, inputs)`` or ``backward(inputs=...)`` without ``W`` among the inputs would still
add into ``W.grad`` here.

The result is what autograd computes up to the order of fp32 additions. It applies only where that
is all that changes (:meth:`TiedWeight.of`): a plain ``nn.Embedding`` (no ``max_norm``,
``scale_grad_by_freq`` or sparse gradient) whose weight is the bias-free ``nn.Linear`` head's, a
trainable fp32 CPU tensor (not FSDP's ``DTensor``) without tensor hooks (``W.register_hook``: they would see
no gradient), an embedding and head without an instance ``forward`` of someone else's, with autograd on. Everything else
takes autograd's path. :func:`~ragen.train.logprobs.policy_forward` uses it for every update and SFT step.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F

#: Vocabulary rows per block of the head's weight gradient (a 4 096 x 576 bf16 block is 4.5 MB).
ROWS = 4096


class TiedWeight:
    """Kept buffers for one tied weight: its ``(V, H)`` compute-dtype copy, a ``(ROWS, H)`` block of the head's
    gradient, and the ``(V, H)`` buffer ``W.grad`` becomes when None."""

    def __init__(self, embedding: torch.nn.Embedding):
        self._weight = weakref.ref(embedding.weight)
        self.padding_idx = embedding.padding_idx
        self.shape = embedding.weight.shape  # the buffers' (V, H)
        self._cast: torch.Tensor | None = None  # (V, H) compute dtype, refreshed per head call
        self._block: torch.Tensor | None = None  # (ROWS, H) compute dtype: one block of a head call's gᵀh
        self._grad: torch.Tensor | None = None  # (V, H) W's dtype: what W.grad is set to when None

    @staticmethod
    def applies(base) -> bool:
        """Whether ``base`` (a transformers causal LM, LoRA unwrapped) has a tied weight this class may take over."""
        get_in, get_out = getattr(base, "get_input_embeddings", None), getattr(base, "get_output_embeddings", None)
        if get_in is None or get_out is None:
            return False
        embedding, head = get_in(), get_out()
        if type(embedding) is not torch.nn.Embedding or type(head) is not torch.nn.Linear or head.bias is not None:
            return False  # subclasses may scale or do more in forward (Gemma's scaled embedding)
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            return False
        if "forward" in vars(embedding) or "forward" in vars(head):
            return False  # someone else's instance forward (an accelerate hook, another switch): leave it alone
        weight = embedding.weight
        return (head.weight is weight and weight.requires_grad and weight.dtype == torch.float32
                and weight.device.type == "cpu" and type(weight.data) is torch.Tensor
                and not weight._backward_hooks)  # tensor hooks on W would see no gradient through this path

    @classmethod
    def of(cls, base) -> "TiedWeight | None":
        """The kept buffers of ``base``'s tied weight (made on first use), or None where :meth:`applies` says no
        or autograd is off (no backward, nothing to keep)."""
        if not torch.is_grad_enabled() or not cls.applies(base):
            return None
        embedding = base.get_input_embeddings()
        key = id(embedding.weight)
        tied = _KEPT.get(key)
        if tied is None or tied._weight() is not embedding.weight:
            weakref.finalize(embedding.weight, _KEPT.pop, key, None)
            tied = None
        # a new padding row, or W's data swapped in place (resize_token_embeddings keeps the Parameter)
        if tied is None or tied.padding_idx != embedding.padding_idx or tied.shape != embedding.weight.shape:
            tied = _KEPT[key] = cls(embedding)
        return tied

    @property
    def weight(self) -> torch.nn.Parameter:
        weight = self._weight()
        if weight is None:
            raise RuntimeError("the tied weight was freed")
        return weight

    def cast(self, dtype: torch.dtype, refresh: bool = True) -> torch.Tensor:
        """``W`` in ``dtype``: ``W`` itself, or the kept copy, refreshed from ``W`` now unless ``refresh`` is False
        (a backward, which reads what its forward refreshed)."""
        weight = self.weight.detach()
        if dtype == weight.dtype:
            return weight
        if self._cast is None or self._cast.dtype != dtype:
            self._cast, refresh = torch.empty_like(weight, dtype=dtype), True
        return self._cast.copy_(weight) if refresh else self._cast

    def block(self, dtype: torch.dtype) -> torch.Tensor:
        """The kept ``(ROWS, H)`` buffer a head backward writes each block of its ``gᵀh`` into."""
        if self._block is None or self._block.dtype != dtype:
            weight = self.weight
            self._block = weight.new_empty((min(ROWS, weight.shape[0]), weight.shape[1]), dtype=dtype)
        return self._block

    def grad(self) -> torch.Tensor:
        """``W.grad`` to accumulate into in place; when it is None, the kept buffer, zeroed."""
        weight = self.weight
        if weight.grad is None:
            if self._grad is None:
                self._grad = torch.empty_like(weight)
            weight.grad = self._grad.zero_()
        return weight.grad

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``(n, V)`` of ``hidden`` ``(n, H)``: ``hidden @ Wᵀ`` in autocast's dtype (``W``'s without autocast)."""
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
        return _TiedHead.apply(hidden.to(dtype), self.weight, self)

    @contextlib.contextmanager
    def swapped(self, embedding: torch.nn.Embedding, head: torch.nn.Linear):
        """Within the block, calls of ``embedding`` and ``head`` run :class:`_TiedLookup` and :meth:`head` (their instance
        ``forward``, so the modules' hooks still run around them); restored on exit."""
        embedding.forward = lambda ids: _TiedLookup.apply(ids, embedding.weight, self)
        head.forward = self.head
        try:
            yield
        finally:
            del embedding.forward, head.forward


#: One :class:`TiedWeight` per tied parameter (by ``id``), for as long as the parameter lives (tensors
#: compare elementwise, so no ``WeakKeyDictionary``).
_KEPT: dict[int, TiedWeight] = {}


class _TiedHead(torch.autograd.Function):
    """``(h (n, H), W (V, H), tied) -> h Wᵀ (n, V)``; backward ``∂h = g W``, and ``W.grad += gᵀh`` in place."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, tied: TiedWeight) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)  # weight: autograd's check that no step changed W before the backward
        ctx.tied = tied
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.mm(hidden, tied.cast(hidden.dtype).t())  # (n, V)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logits: torch.Tensor):
        hidden, _ = ctx.saved_tensors
        tied: TiedWeight = ctx.tied
        with torch.autocast(hidden.device.type, enabled=False):
            grad_logits = grad_logits.to(hidden.dtype)  # (n, V)
            grad_hidden = torch.mm(grad_logits, tied.cast(hidden.dtype, refresh=False))  # (n, H)
            grad, block = tied.grad(), tied.block(hidden.dtype)
            for start in range(0, grad.shape[0], ROWS):
                end = min(start + ROWS, grad.shape[0])
                part = torch.mm(grad_logits[:, start:end].t(), hidden, out=block[: end - start])  # (k, H) of gᵀh
                grad[start:end].add_(part)
        return grad_hidden, None, None


class _TiedLookup(torch.autograd.Function):
    """``(ids (...), W (V, H), tied) -> W[ids] (..., H)``; backward ``W.grad[x] += ∂emb`` row by row, in place."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, tied: TiedWeight) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.tied = tied
        return F.embedding(ids, weight, tied.padding_idx)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows: torch.Tensor):
        (ids,) = ctx.saved_tensors
        tied: TiedWeight = ctx.tied
        rows = ids.reshape(-1)  # (n,)
        grad_rows = grad_rows.reshape(rows.shape[0], -1)  # (n, H)
        if tied.padding_idx is not None:  # nn.Embedding leaves the padding row's gradient at zero
            keep = rows != tied.padding_idx
            rows, grad_rows = rows[keep], grad_rows[keep]
        grad = tied.grad()
        grad.index_add_(0, rows, grad_rows.to(grad.dtype))
        return None, None, None


@contextlib.contextmanager
def tied_weight_for(base, enabled: bool = True):
    """Within the block, ``base``'s embedding lookups and LM-head calls take the tied weight's kept-memory path
    (:meth:`TiedWeight.swapped`); yields the :class:`TiedWeight`, or None where it does not apply."""
    tied = TiedWeight.of(base) if enabled else None
    if tied is None:
        yield None
        return
    with tied.swapped(base.get_input_embeddings(), base.get_output_embeddings()):
        yield tied
