"""One flat CPU buffer, grown to the largest request and never shrunk, handed out as views of the shape asked for.

Every freshly allocated large tensor starts as untouched pages that the kernel faults in and zero-fills one 4 KiB
page at a time (on this project's VM that cost varies with the host: ``docs/performance.md``). Scratch tensors that
a hot path allocates again and again -- the casts that only feed oneDNN's weight reorder
(:class:`~ragen.models.fused_decode.FusedDecoder`), the target log-probs' fp32 row blocks
(:mod:`ragen.train.target_logprobs`) -- land instead on pages that are already mapped. A view is valid until the
next :meth:`KeptBuffer.view` call: only for data that is consumed before that.
"""

from __future__ import annotations

import math

import torch


class KeptBuffer:
    """A reused scratch buffer: :meth:`view` returns ``shape``-shaped ``dtype`` views of one flat allocation."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None  # flat, grown to the largest request, never shrunk

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, spare: float = 1.0) -> torch.Tensor:
        """A ``shape``-shaped ``dtype`` view; where the buffer must grow, it grows to ``spare`` times the request (for
        requests that grow call by call, such as a multi-turn rollout's caches: the next ones then fit)."""
        numel = math.prod(shape)
        if self.buffer is None or self.buffer.dtype != dtype or self.buffer.numel() < numel:
            self.buffer = None  # free the old buffer first
            self.buffer = torch.empty(math.ceil(numel * max(spare, 1.0)), dtype=dtype)
        return self.buffer[:numel].view(shape)
