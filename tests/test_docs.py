"""The README and docs/ are tested like code: links and file paths they name exist, and the commands they mark
runnable run.

A fenced block whose info string is ``bash runnable`` is run, line by line, each line a shell command, in a fresh
temporary directory with this checkout's ``ragen`` first on ``PATH``; a non-zero exit fails the test. Such blocks use
``model=tiny`` and a few steps, so they take seconds: they prove the commands a user copies still parse and run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
#: Backticked paths into the repository: `ragen/...`, `docs/...`, `benchmarks/...`, `scripts/...`, `tests/...`.
PATH = re.compile(r"`((?:ragen|docs|benchmarks|scripts|tests|examples)/[\w./-]+?)(?:::\w+)?`")


def _pages_text():
    return [(page, page.read_text()) for page in PAGES]


def test_there_are_pages():
    assert len(PAGES) > 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_named_paths_exist(page):
    text = page.read_text()
    missing = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    for path in PATH.findall(text):
        candidate = path.rstrip(".")
        if any(ch in candidate for ch in "*<>{}") or candidate.endswith("/"):
            continue
        if not (ROOT / candidate).exists():
            missing.append(candidate)
    assert not missing, f"{page.name} names paths that do not exist: {sorted(set(missing))}"


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page, text in _pages_text():
        for info, body in FENCE.findall(text):
            if info.strip().split()[:2] == ["bash", "runnable"]:
                blocks.append((f"{page.relative_to(ROOT)}:{text[:text.index(body)].count(chr(10)) + 1}", body))
    return blocks


def test_some_blocks_are_marked_runnable():
    assert runnable_blocks(), "no ```bash runnable block in README.md or docs/"


@pytest.mark.parametrize("where,body", runnable_blocks(), ids=[w for w, _ in runnable_blocks()])
def test_runnable_commands_run(where, body, tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT)}
    for line in body.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{where}: `{line}` exited {done.returncode}:\n{done.stderr[-2000:]}"
