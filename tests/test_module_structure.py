"""The package's structure: no import circle among ragen's modules, and no module over ~500 lines grows unnoticed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_import_circle():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "module_map.py"), "--cycles"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout


def test_the_circle_finder_finds_a_circle(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import module_map
    finally:
        sys.path.pop(0)
    assert module_map.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert module_map.cycles({"a": {"b"}, "b": set()}) == []


def test_the_architecture_page_draws_the_current_module_map():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "module_map.py")], capture_output=True, text=True,
                          check=True)
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawn = page.split("<!-- module-map:start -->\n", 1)[1].split("\n<!-- module-map:end -->", 1)[0]
    assert drawn == done.stdout.strip(), "redraw it: .venv/bin/python scripts/module_map.py"
