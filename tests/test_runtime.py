"""ragen/runtime.py: with RAGEN_MALLOC=keep, a step's large tensors reuse the last step's pages; without it,
nothing changes."""

import os
import platform
import subprocess
import sys
import warnings

import pytest

from ragen import runtime

#: One "step": large tensors (256 × 49 152 fp32 = 48 MiB each: past glibc's largest dynamic mmap threshold, 32 MiB,
#: so by default every one is a fresh mmap, as an update's logits are) alive together, then freed.
PROBE = """
import resource, sys, torch
from ragen.runtime import keep_freed_memory
applied = keep_freed_memory()
def faults_of_a_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = torch.randn(256, 49152); b = a.exp(); c = torch.log_softmax(a, -1); d = b * c
    del a, b, c, d
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, *[faults_of_a_step() for _ in range(5)])
"""
STEP_PAGES = 4 * 256 * 49152 * 4 // 4096  # the step's four blocks in 4 KiB pages
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


def fresh_process(script: str, **env) -> list[str]:
    """The words ``script`` prints in a fresh process with glibc's default malloc settings plus ``env``."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("MALLOC_") and k not in ("RAGEN_MALLOC", "GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")}
    return subprocess.run([sys.executable, "-c", script], env={**environ, **env}, capture_output=True,
                          text=True, check=True).stdout.split()


def probe(**env) -> tuple[bool, list[int]]:
    """(applied, page faults of each of 5 steps) in a fresh process with glibc's defaults plus ``env``."""
    out = fresh_process(PROBE, **env)
    return out[0] == "True", [int(x) for x in out[1:]]


def huge_pages_always() -> bool:
    """With transparent huge pages always on, a fresh block faults once per 2 MiB: glibc's default is cheap too."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@glibc
def test_a_steps_large_tensors_reuse_freed_pages_when_asked():
    applied, faults = probe(RAGEN_MALLOC="keep")
    assert applied
    assert faults[-1] < STEP_PAGES // 100  # after warm-up: the pages are already there
    default_applied, default_faults = probe()  # not asked: glibc's defaults
    assert not default_applied
    if not huge_pages_always():
        assert min(default_faults) > STEP_PAGES // 2  # every block a fresh mmap, faulted in again


@glibc
@pytest.mark.parametrize("env", [{"MALLOC_ARENA_MAX": "2"}, {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}])
def test_the_users_own_malloc_settings_win(env):
    applied, faults = probe(RAGEN_MALLOC="keep", **env)
    assert not applied
    if not huge_pages_always():
        assert faults[-1] > STEP_PAGES // 2  # glibc left as configured: still faulting every step


def test_the_ragen_command_and_the_trainer_call_it(monkeypatch, tmp_path):
    from ragen import cli
    from ragen.config import load_config
    from ragen.train import trainer as trainer_module

    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append("cli"))
    monkeypatch.setattr(trainer_module, "keep_freed_memory", lambda: calls.append("trainer"))
    assert cli.main(["envs"]) == 0
    trainer_module.StarPOTrainer(load_config("bandit", ["model=tiny", f"trainer.output_dir={tmp_path / 'run'}",
                                                        "trainer.progress_bar=false", "trainer.logger=[jsonl]"]))
    assert calls == ["cli", "trainer"]


def test_the_state_line_says_what_was_applied(monkeypatch):
    monkeypatch.setattr(runtime, "_applied", False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    assert "defaults" in runtime.allocator_state()
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert "own settings" in runtime.allocator_state()
    monkeypatch.setattr(runtime, "_applied", True)
    assert "keeps freed memory" in runtime.allocator_state()


def test_an_unknown_value_warns_and_changes_nothing(monkeypatch):
    monkeypatch.setenv("RAGEN_MALLOC", "kep")
    with pytest.warns(UserWarning, match="RAGEN_MALLOC='kep'"):
        assert runtime.requested() is False
    for value in ("default", ""):
        monkeypatch.setenv("RAGEN_MALLOC", value)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert runtime.requested() is False


#: Holes in glibc's heap: a 16 MiB block freed raises the mmap threshold, so 4 MiB tensors come from the heap; every
#: other one is freed while its neighbours live, leaving 4 MiB holes that stay resident until a trim.
HOLES = """
import sys, torch
from ragen.runtime import keep_freed_memory, return_freed_memory
keep_freed_memory()
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) * 1024
big = torch.ones(4 * 2**20); del big
blocks = [torch.ones(2**20) for _ in range(100)]
blocks = blocks[1::2]
before = rss()
trimmed = return_freed_memory()
print(trimmed, (before - rss()) // 2**20)
"""


def holes(**env) -> tuple[bool, int]:
    """(trimmed, MiB the trim gave back) in a fresh process with glibc's defaults plus ``env``."""
    out = fresh_process(HOLES, **env)
    return out[0] == "True", int(out[1])


@glibc
def test_freed_holes_in_the_heap_go_back_to_the_kernel_unless_kept_on_purpose():
    trimmed, returned_mib = holes()
    assert trimmed and returned_mib >= 150  # most of the 50 holes of 4 MiB
    kept, kept_returned = holes(RAGEN_MALLOC="keep")
    assert not kept and kept_returned < 10
