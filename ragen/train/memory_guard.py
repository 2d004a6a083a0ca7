"""A warning before the kernel's OOM killer: after each of a run's first steps, compare the process's peak resident
memory with what the machine could still give it, and say once which keys to lower if the run is close to the edge.

The first steps are where a run's memory settles (AdamW allocates its moments in the first optimizer step, the
longest episodes of a preset show up early), so a run whose peak already fills most of the memory it can have would
be killed later without a word. Linux only (``/proc``); elsewhere it stays silent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

GiB = 2**30

#: Warn when the peak so far exceeds this share of the memory the process can have (its RSS + what is available).
NEAR_LIMIT = 0.8


def _status_bytes(field: str, path: str = "/proc/self/status") -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss() -> int | None:
    """This process's peak resident memory in bytes (``VmHWM``), or None off Linux."""
    return _status_bytes("VmHWM")


def current_rss() -> int | None:
    return _status_bytes("VmRSS")


def available_memory() -> int | None:
    """What the machine can still give (``MemAvailable``), in bytes, or None off Linux."""
    return _status_bytes("MemAvailable", "/proc/meminfo")


class MemoryGuard:
    """Checks after each of the first ``steps`` steps; warns at most once, naming ``keys`` (the knobs to lower)."""

    def __init__(self, keys: list[str], say: Callable[[str], None], steps: int = 3,
                 peak=peak_rss, rss=current_rss, available=available_memory):
        self.keys, self.say, self.steps = keys, say, steps
        self._peak, self._rss, self._available = peak, rss, available
        self.warned = False

    def after_step(self, step: int) -> bool:
        """True if it warned now."""
        if self.warned or step > self.steps:
            return False
        peak, rss, free = self._peak(), self._rss(), self._available()
        if None in (peak, rss, free):
            return False
        limit = rss + free  # what this process could grow to if nothing else on the machine grew
        if peak <= NEAR_LIMIT * limit:
            return False
        self.warned = True
        self.say(f"[ragen] memory: step {step} peaked at {peak / GiB:.1f} GB of the {limit / GiB:.1f} GB this process "
                 f"can have; later steps with longer episodes may be killed by the system. Lower "
                 f"{', '.join(self.keys)} (docs/performance.md, \"Memory\").")
        return True


#: What to lower in an RL run, most effective first.
RL_KEYS = ["algorithm.max_tokens_per_micro_batch", "rollout.max_episodes_in_flight", "rollout.reuse_kv_max_gb",
           "or set lora.rank"]
#: What to lower in an SFT run.
SFT_KEYS = ["trainer.max_tokens_per_micro_batch", "or set lora.rank"]
