"""``ragen view`` / ``ragen plot`` on damaged logs and awkward names: no crash, nothing silently lost or misdrawn."""

import json
import os

import pytest

from ragen.viz.episode_html import render_tokens
from ragen.viz.viewer import build_site


def _run(root, name="run", rows=({"step": 1, "train/success": 0.5},), trajs=()):
    run = root / name
    (run / "rollouts").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if trajs:
        (run / "rollouts" / "step_000001.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trajs))
    return run


def test_a_step_that_looks_like_a_number_but_is_not_does_not_crash_the_viewer(tmp_path):
    rows = [{"step": "--3", "train/success": 0.1}, {"step": "\u00b2", "train/success": 0.2},
            {"step": "9" * 5000, "train/success": 0.3}, {"step": 1, "train/success": 0.5}]
    index = build_site(_run(tmp_path, rows=rows), tmp_path / "out")
    assert "<td>1</td>" in index.read_text()


def test_text_utf8_cannot_hold_does_not_crash_the_viewer(tmp_path):
    # lone surrogates: valid in JSON ("\ud800"), and what Python makes of a non-UTF-8 file name
    traj = {"env": "bandit", "turns": [{"response": "a\ud800b"}], "tokens": ["\udcff"], "loss_mask": [1],
            "advantages": [1.0]}
    run = _run(tmp_path, os.fsdecode(b"run\xff"), rows=[{"step": 1, "train/success": 0.5, "x\ud800": 1.0}], trajs=[traj])
    index = build_site(run, tmp_path / "out")
    assert "a?b" in (tmp_path / "out" / "step_000001" / "traj_0000.html").read_text(encoding="utf-8")
    assert "run?" in index.read_text(encoding="utf-8")


def test_rebuilding_replaces_pages_atomically(tmp_path):
    """``ragen view`` is re-run on a live run (maybe under ``--serve``): a reader never gets a half-written page."""
    run = _run(tmp_path, trajs=[{"env": "bandit", "turns": []}])
    out = tmp_path / "out"
    build_site(run, out)
    pages = [out / "index.html", out / "step_000001.html", out / "step_000001" / "traj_0000.html"]
    readers = [open(page, encoding="utf-8") for page in pages]  # opened before the rebuild, read after it
    before = [page.read_text(encoding="utf-8") for page in pages]
    try:
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 2, "train/success": 0.75}) + "\n")
        build_site(run, out)
        assert [reader.read() for reader in readers] == before  # the old file was replaced, not rewritten in place
    finally:
        for reader in readers:
            reader.close()
    assert "0.75" in pages[0].read_text(encoding="utf-8")
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def test_a_nan_advantage_is_not_shown_as_advantage_zero():
    # the rollout log writes a NaN advantage as null
    traj = {"tokens": ["a", "b", "c"], "loss_mask": [1, 1, 1], "advantages": [0.0, None, 0.5], "in_update": True}
    spans = render_tokens(traj, 1.0).split("<span ")[1:]
    assert spans[0].startswith("class='z'")  # exactly 0: white, dotted
    assert not spans[1].startswith("class='z'") and "not a number" in spans[1]
    assert spans[2].startswith("class='p4'")


# ----------------------------------------------------------------------------- plots


def _plot_run(root, name, slope):
    run = root / name
    run.mkdir(parents=True)
    rows = [{"step": s, "train/success": slope * s, "actor/entropy": 2.0 - slope * s} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_every_run_is_in_the_legend_even_one_named_with_a_leading_underscore(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from ragen.viz.plots import plot_runs

    legends = []
    real_legend = matplotlib.axes.Axes.legend

    def spy(ax, *args, **kwargs):
        legend = real_legend(ax, *args, **kwargs)
        legends.append([t.get_text() for t in legend.get_texts()])
        return legend

    monkeypatch.setattr(matplotlib.axes.Axes, "legend", spy)
    runs = [_plot_run(tmp_path, "_baseline", 0.1), _plot_run(tmp_path, "tuned", 0.2)]
    plot_runs(runs, tmp_path / "c.png")
    assert legends and all(labels == ["_baseline", "tuned"] for labels in legends), legends


def test_a_run_dir_whose_name_is_not_utf8_is_plotted(tmp_path):
    pytest.importorskip("matplotlib")
    from ragen.viz.plots import plot_runs

    run = _plot_run(tmp_path, os.fsdecode(b"run\xff"), 0.1)
    (path,) = plot_runs([run])  # what the trainer does at the end of every run
    assert path.read_bytes().startswith(b"\x89PNG")


def test_a_failed_plot_leaves_the_previous_png_whole(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from ragen.viz.plots import plot_runs

    run = _plot_run(tmp_path, "run", 0.1)
    (target,) = plot_runs([run])
    old = target.read_bytes()

    def broken_savefig(fig, fname, **kwargs):  # e.g. the disk fills up half way through the PNG
        if hasattr(fname, "write"):
            fname.write(old[:100])
        else:
            with open(fname, "wb") as f:
                f.write(old[:100])
        raise OSError("No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken_savefig)
    with pytest.raises(OSError):
        plot_runs([run])
    assert target.read_bytes() == old
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


def test_an_integer_too_large_for_a_float_is_an_infinite_value_not_a_crash(tmp_path):
    pytest.importorskip("matplotlib")
    from ragen.viz.plots import load_curves, plot_runs

    run = _plot_run(tmp_path, "run", 0.1)
    with open(run / "metrics.jsonl", "a") as f:  # a damaged digit run: JSON reads it as an int, float() overflows
        f.write('{"step": 6, "train/success": 0.6, "actor/entropy": 1' + "0" * 400 + "}\n")
    assert load_curves(run)["actor/entropy"][-1] == (6.0, float("inf"))
    assert plot_runs([run])[0].is_file()
    traj = {"tokens": ["a", "b"], "loss_mask": [1, 1], "advantages": [int("1" + "0" * 400), 0.5], "in_update": True}
    assert "class='p4'" in render_tokens(traj, 1.0)


def test_only_step_files_are_read_and_a_byte_order_mark_loses_no_line(tmp_path):
    from ragen.viz.page import read_jsonl
    from ragen.viz.viewer import _rollout_files

    run = _run(tmp_path, trajs=[{"env": "bandit", "turns": []}])
    (run / "rollouts" / "backup_step_000001.jsonl").write_text("{}\n")  # a user's copy: not step 1's log
    assert {k: p.name for k, p in _rollout_files(run).items()} == {1: "step_000001.jsonl"}
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"step": 1}\n{"step": 2}\n')  # a file saved by an editor that adds a BOM
    assert [row["step"] for row in read_jsonl(bom)] == [1, 2]
