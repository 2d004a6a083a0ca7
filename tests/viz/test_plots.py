"""``ragen plot``: curves of several runs in one valid PNG."""

import json

import pytest

pytest.importorskip("matplotlib")

from ragen.cli import main  # noqa: E402
from ragen.viz.plots import load_curves, plot_runs  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(root, name, slope, val=True):
    run = root / name
    run.mkdir(parents=True)
    rows = []
    for step in range(1, 11):
        rows.append({"step": step, "train/success": min(1.0, slope * step), "train/reward_mean": slope * step - 0.5,
                     "actor/entropy": 2.0 - 0.1 * step, "actor/grad_norm": 1.0 / step,
                     "train/response_length": 50 - step, "time/step_s": 3.0})
        if val and step % 5 == 0:
            rows.append({"step": step, "val/success": slope * step})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return run


def _is_png(path):
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_two_runs_one_png(tmp_path):
    a, b = _run(tmp_path, "grpo", 0.1), _run(tmp_path, "ppo", 0.05, val=False)
    paths = plot_runs([a, b], tmp_path / "out")
    assert paths == [tmp_path / "out" / "curves.png"]
    assert _is_png(paths[0])
    explicit = plot_runs([a, b], tmp_path / "cmp.png")
    assert explicit == [tmp_path / "cmp.png"] and _is_png(explicit[0])


def test_default_output_and_curves(tmp_path):
    a = _run(tmp_path, "solo", 0.1)
    assert plot_runs([a]) == [a / "curves.png"] and _is_png(a / "curves.png")
    curves = load_curves(a)
    assert curves["val/success"] == [(5.0, 0.5), (10.0, 1.0)]
    assert len(curves["train/success"]) == 10


def test_cli_plot_and_errors(tmp_path, capsys):
    a, b = _run(tmp_path / "x", "run", 0.1), _run(tmp_path / "y", "run", 0.2)
    assert main(["plot", str(a), str(b), "--out", str(tmp_path / "p.png")]) == 0
    assert str(tmp_path / "p.png") in capsys.readouterr().out and _is_png(tmp_path / "p.png")
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"step": 1, "foo": 1}\n')
    assert main(["plot", str(empty)]) == 2
    assert "none of the plotted metrics" in capsys.readouterr().err
