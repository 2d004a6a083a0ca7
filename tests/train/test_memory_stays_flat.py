"""Resident memory stays flat over a long run: after the first steps, RL and SFT on the embedded model grow by less
than 5 % (the fast guard, that no step keeps tensors of an earlier one, is tests/train/test_no_tensors_kept_across_steps.py).

Each run is a fresh process of ``benchmarks/bench_memory_presets.py`` (its RSS is the run's alone): a few minutes
on 2 cores, so marked slow (``make test-slow``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_memory_presets.py"
STEPS = 30
SETTLED = 5  # steps after which the allocator has seen every shape the run uses


def rss_after_each_step(kind: str, name: str) -> list[int]:
    cmd = [sys.executable, str(BENCH), "--child", kind, "--child-name", name, "--steps", str(STEPS), "--threads", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])["rss"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rl", "sft"])
def test_the_bandit_presets_memory_grows_less_than_5_percent_after_its_first_steps(kind):
    rss = rss_after_each_step(kind, "bandit")
    assert len(rss) == STEPS
    growth = (rss[-1] - rss[SETTLED - 1]) / rss[SETTLED - 1]
    assert growth < 0.05, f"{kind}: {rss[SETTLED - 1] / 2**20:.0f} MiB after step {SETTLED}, {rss[-1] / 2**20:.0f} at the end"
