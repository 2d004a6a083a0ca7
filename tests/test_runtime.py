"""ragen/runtime.py: with glibc keeping freed memory, a step's large tensors reuse the last step's pages."""

import os
import subprocess
import sys

import pytest

#: One "step": update-sized tensors (1 024 × 49 152 fp32 = 192 MiB each) alive together, then freed.
PROBE = """
import resource, sys, torch
from ragen.runtime import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def faults_of_a_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = torch.randn(1024, 49152); b = a.exp(); c = torch.log_softmax(a, -1); d = b * c
    del a, b, c, d
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, *[faults_of_a_step() for _ in range(5)])
"""


def probe(mode: str, **env) -> tuple[bool, list[int]]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "RAGEN_MALLOC"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**environ, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0] == "True", [int(x) for x in out[1:]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_steps_large_tensors_reuse_freed_pages():
    pages = 4 * 1024 * 49152 * 4 // 4096  # the step's four blocks
    applied, faults = probe("keep")
    assert applied
    assert faults[-1] < pages // 100  # after warm-up: the pages are already there
    default_applied, default_faults = probe("default")
    assert not default_applied
    assert min(default_faults) > pages // 2  # glibc's default: each block is a fresh mmap, faulted in again


def test_the_users_own_malloc_settings_win():
    assert probe("keep", MALLOC_ARENA_MAX="2")[0] is False
    assert probe("keep", RAGEN_MALLOC="default")[0] is False
