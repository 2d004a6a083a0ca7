"""Opt-in allocator setting for training on a CPU (``RAGEN_MALLOC=keep``): glibc keeps freed memory.

torch allocates CPU tensors with ``malloc``. glibc serves a block above its mmap threshold (at
most 32 MB) with a fresh ``mmap`` and unmaps it on ``free``, so every large tensor of a step --
an update's ``(tokens, vocabulary)`` logits and their softmax, exp and gradients, the LM head's
gradient, a cast copy of a weight -- starts as untouched pages that the kernel faults in and
zero-fills one 4 KiB page at a time. With mmap off (``M_MMAP_MAX`` = 0) the main arena serves
every block from its heap, and with a high trim threshold freed blocks stay mapped, so the next
step's tensors land on pages that are already there. This covers tensors allocated on the main
thread, where torch runs the ops a training step launches; glibc's other arenas (threads that
allocate themselves) still map large blocks afresh.

Measured on a 2-core Xeon VM: ``tests/test_runtime.py``'s
probe (four 192 MiB tensors per iteration) faults ~196 600 pages per iteration with glibc's
defaults (every page of the four blocks) and 0 by the fifth iteration with this setting
(``.venv/bin/python -c "import tests.test_runtime as t; print(t.probe()); print(t.probe(RAGEN_MALLOC='keep'))"``:
196 612 each time, then 196 695, 196 608, 147 456, 147 456, 0). Updates at ``bench_vs_trl.py``'s
shape: 3.12 → 2.88 s for ragen and 7.19 → 5.62 s for TRL in the committed benchmark (two runs),
3.32 → 2.53 s in an earlier alternation through the ``MALLOC_*`` environment variables.

The cost is resident memory, and it is why this is opt-in: freed heap is kept (up to
:data:`TRIM_THRESHOLD` at its top; holes below the top are never returned), so RSS stays near the
process's peak so far and can grow past it when tensor sizes vary. An SFT run on twenty-turn
FrozenLake chats (micro-batches of 8 chats of ~1 100 tokens) was killed by the kernel's OOM killer
at 23 GB with the setting, while the same run with glibc's defaults levelled off at 21.5 GB; with
micro-batches of 4 it had reached 14.7 GB and was still growing after 4 steps. Results do not
change (only where memory comes from).

Applied by the ``ragen`` command, :class:`~ragen.train.trainer.StarPOTrainer` and Ray rollout
workers only when ``RAGEN_MALLOC=keep`` is set, and never when the environment tunes malloc itself
(``MALLOC_*`` variables, ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``) or off glibc. Once
applied it lasts for the process.
"""

from __future__ import annotations

import ctypes
import os
import platform
import warnings

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
#: Freed memory kept at the top of the heap before glibc trims it (mallopt takes a C int).
TRIM_THRESHOLD = 2**31 - 1


def users_own_settings() -> bool:
    """True if the environment already tunes glibc's malloc (then ragen leaves it alone)."""
    return any(k.startswith("MALLOC_") for k in os.environ) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


#: What ``RAGEN_MALLOC`` may say: ``keep`` applies the setting; empty or ``default`` leaves glibc alone.
VALUES = ("keep", "default", "")


def requested(force: bool = False) -> bool:
    """True if the setting should be applied: asked for (``RAGEN_MALLOC=keep`` or ``force``), not
    overridden by the environment's own malloc settings, and on glibc. Any other value than
    :data:`VALUES` (a typo such as ``kep``) warns once and counts as not asked for."""
    value = os.environ.get("RAGEN_MALLOC", "")
    if value not in VALUES:
        warnings.warn(f"RAGEN_MALLOC={value!r} is not one of 'keep', 'default': read as not set", stacklevel=2)
    asked = force or value == "keep"
    return asked and not users_own_settings() and platform.libc_ver()[0] == "glibc"


_applied = False


def keep_freed_memory(force: bool = False) -> bool:
    """With ``RAGEN_MALLOC=keep`` (or ``force``), serve large allocations from glibc's heap and keep
    freed memory for reuse; True if applied."""
    global _applied
    if not requested(force):
        return False
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):  # TypeError: no process handle to open (Windows)
        return False
    _applied = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied


def return_freed_memory() -> bool:
    """Hand the free pages inside glibc's heaps back to the kernel (``malloc_trim(0)``); True if it returned any.

    Blocks below glibc's mmap threshold (which rises to 32 MB as large blocks are freed) come from its heaps, and a
    free block between two live ones stays resident: a rollout whose KV caches grow a little every turn leaves such
    holes behind, and without a trim each rollout or evaluation wave adds to the process's resident memory
    (``docs/performance.md``, the waved slippery FrozenLake evaluation). Called where a rollout or a training step
    has just freed its tensors; a no-op under ``RAGEN_MALLOC=keep``, which keeps freed memory on purpose, and off
    glibc."""
    if _applied or platform.libc_ver()[0] != "glibc":
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, TypeError, AttributeError):
        return False
    return bool(trim(0))


def allocator_state() -> str:
    """What this process's allocator runs with, for benchmark headers."""
    if _applied:
        return "glibc keeps freed memory (ragen/runtime.py)"
    if users_own_settings():
        return "the environment's own settings (MALLOC_* / GLIBC_TUNABLES)"
    return "the C library's defaults"
