"""Process-wide allocator setting for training on a CPU: glibc keeps freed memory for reuse.

torch allocates CPU tensors with ``malloc``. glibc serves a block above its mmap threshold (at
most 32 MB) with a fresh ``mmap`` and unmaps it on ``free``, so every large tensor of a step --
an update's ``(tokens, vocabulary)`` logits and their softmax, exp and gradients, the LM head's
gradient, a cast copy of a weight -- starts as untouched pages that the kernel faults in and
zero-fills one 4 KiB page at a time. With mmap off (``M_MMAP_MAX`` = 0) every block comes
from the heap, and with a high trim threshold freed blocks stay mapped, so the next step's
tensors land on pages that are already there.

Measured on a 2-core Xeon VM (docs/performance.md, "On a Xeon with AMX"): a loop of
update-sized tensors faulted 238 000 pages per iteration with glibc's defaults and 0 after two
warm-up iterations with this setting (``tests/test_runtime.py`` checks the same effect); an
update at ``bench_vs_trl.py``'s shape took 3.32 s → 2.53 s (bf16, median of 3 alternations of
two processes' settings, set through the equivalent ``MALLOC_*`` environment variables).

The cost is resident memory: freed heap is kept (up to :data:`TRIM_THRESHOLD` at its top), so
RSS stays near the run's peak instead of falling between steps. Results do not change (only
where memory comes from). Not applied when the user set any ``MALLOC_*`` tunable of their own,
when ``RAGEN_MALLOC=default``, or off glibc. Once applied it lasts for the process.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
#: Freed memory kept at the top of the heap before glibc trims it (mallopt takes a C int).
TRIM_THRESHOLD = 2**31 - 1


def keep_freed_memory() -> bool:
    """Serve every allocation from glibc's heap and keep freed memory for reuse; True if applied."""
    if os.environ.get("RAGEN_MALLOC", "") == "default" or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only (musl, macOS: leave the allocator alone)
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
