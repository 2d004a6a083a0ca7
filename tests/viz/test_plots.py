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


def test_non_finite_values_are_gaps_named_in_the_title_and_names_are_text(tmp_path, monkeypatch):
    import math

    import matplotlib.axes

    run = _run(tmp_path, "a$x^2$", 0.1)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[3]["actor/entropy"], rows[4]["actor/grad_norm"] = math.nan, math.inf
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert math.isnan(dict(load_curves(run)["actor/entropy"])[4.0])  # kept, not dropped
    drawn, titles = {}, []
    real_plot, real_title = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, xs, ys, **kw: drawn.setdefault(len(drawn), list(ys)) and real_plot(ax, xs, ys, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda ax, t, **kw: titles.append(t) or real_title(ax, t, **kw))
    assert _is_png(plot_runs([run])[0])  # a '$' in the name is drawn as text, not parsed as math
    assert any(t.startswith("actor entropy") and "NaN/inf at step 4" in t for t in titles), titles
    assert any("NaN/inf at step 5" in t for t in titles if "grad" in t), titles
    assert sum(math.isnan(y) for ys in drawn.values() for y in ys) == 2  # both drawn as gaps


def test_a_run_with_no_plotted_metric_among_several_is_an_error(tmp_path, capsys):
    a = _run(tmp_path, "good", 0.1)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert main(["plot", str(a), str(empty), "--out", str(tmp_path / "two.png")]) == 2
    assert f"{empty}: none of the plotted metrics" in capsys.readouterr().err
