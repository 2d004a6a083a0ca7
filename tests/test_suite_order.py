"""tests/conftest.py's RUN_FIRST: the files it schedules first exist (a renamed one would silently lose its place)."""

from pathlib import Path

from tests.conftest import RUN_FIRST

ROOT = Path(__file__).resolve().parent.parent


def test_every_run_first_file_exists_once():
    assert len(set(RUN_FIRST)) == len(RUN_FIRST)
    missing = [name for name in RUN_FIRST if not (ROOT / name).is_file()]
    assert not missing, f"tests/conftest.py RUN_FIRST names files that do not exist: {missing}"
