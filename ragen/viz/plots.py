"""Training curves from one or more run directories: ``ragen plot RUN_DIR [RUN_DIR ...]``.

Reads each ``RUN_DIR/metrics.jsonl`` and draws one PNG with a subplot per metric (success,
validation success where logged, reward, entropy, grad norm, response length), one line per run,
labelled by the run directory's name. Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Sequence

from ragen.files import atomic_open, file_in_the_way
from ragen.viz.page import json_number, read_jsonl

__all__ = ["PANELS", "load_curves", "plot_runs"]

# (title, candidate metric keys: the first one a run has is used)
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train success", ("train/success", "train/success_rate", "success")),
    ("val success", ("val/success", "val/success_rate")),
    ("train reward (mean)", ("train/reward_mean", "train/reward", "reward_mean")),
    ("actor entropy", ("actor/entropy",)),
    ("actor grad norm", ("actor/grad_norm",)),
    ("response length (tokens)", ("train/response_length", "train/response_length_mean")),
)

DEFAULT_NAME = "curves.png"


def load_curves(run_dir: str | os.PathLike) -> dict[str, list[tuple[float, float]]]:
    """``{metric key: [(step, value), ...]}`` from ``RUN_DIR/metrics.jsonl`` (non-numeric values skipped).

    Rows without a numeric ``step`` use their line position. Raises ``FileNotFoundError`` if the
    run has no metrics file.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    curves: dict[str, list[tuple[float, float]]] = {}
    for position, row in enumerate(read_jsonl(path)):
        step = json_number(row.get("step"))
        x = step if step is not None and math.isfinite(step) else float(position)
        for key, value in row.items():
            if key == "step":
                continue
            y = math.nan if value is None else json_number(value)  # the log writes NaN and inf as null: a gap
            if y is not None:
                curves.setdefault(key, []).append((x, y))
    for points in curves.values():
        points.sort(key=lambda p: p[0])
    return curves


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Directory names; parent/name where two runs share a name."""
    names = [p.resolve().name or str(p) for p in run_dirs]
    out = []
    for path, name in zip(run_dirs, names):
        if names.count(name) > 1:
            name = f"{path.resolve().parent.name}/{name}"
        out.append(name)
    if len(set(out)) < len(out):  # still ambiguous: number them
        out = [f"{i}: {label}" for i, label in enumerate(out)]
    # a directory name is text, not matplotlib's $math$; what UTF-8 cannot hold (a non-UTF-8 name) becomes "?"
    return [label.replace("$", r"\$").encode("utf-8", "replace").decode("utf-8") for label in out]


def _output_path(run_dirs: Sequence[Path], out: str | os.PathLike | None) -> Path:
    if out is None:
        target = run_dirs[0] / DEFAULT_NAME if len(run_dirs) == 1 else Path.cwd() / DEFAULT_NAME
    else:
        target = Path(out)
        if target.suffix.lower() != ".png":
            target = target / DEFAULT_NAME
    in_the_way = file_in_the_way(target.parent)
    if in_the_way is not None:
        raise FileExistsError(f"--out {out}: {in_the_way} is a file, not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def plot_runs(
    run_dirs: Sequence[str | os.PathLike],
    out: str | os.PathLike | None = None,
    *,
    dpi: int = 110,
) -> list[Path]:
    """Plot the runs' curves into one PNG; return ``[path]``.

    ``out`` is a ``.png`` file or a directory (``curves.png`` inside it); by default the run dir for
    one run, the current directory for several. Panels no run has data for are left out
    (``val success`` appears only when some run logged it).
    """
    if not run_dirs:
        raise ValueError("plot_runs: give at least one run directory")
    paths = [Path(p) for p in run_dirs]
    curves = [load_curves(p) for p in paths]
    labels = _labels(paths)

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = []
    for title, keys in PANELS:
        series = []
        for label, run in zip(labels, curves):
            key = next((k for k in keys if any(math.isfinite(y) for _, y in run.get(k, ()))), None)  # a value to draw
            if key is not None:
                series.append((label, key, run[key]))
        if series:
            panels.append((title, series))
    if not panels:
        known = sorted({k for run in curves for k in run})
        raise ValueError(f"plot_runs: none of the plotted metrics found; metrics present: {known}")
    plotted = {label for _, series in panels for label, _, _ in series}
    missing = [str(path) for path, label in zip(paths, labels) if label not in plotted]
    if missing:  # a run that would be named in the title with no line anywhere
        raise ValueError(f"plot_runs: {', '.join(missing)}: none of the plotted metrics in its metrics.jsonl")

    ncols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 3.4 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    color_of = {label: colors[i % len(colors)] for i, label in enumerate(labels)}
    for ax, (title, series) in zip(axes.flat, panels):
        odd = sorted({int(x) if float(x).is_integer() else x for _, _, points in series for x, y in points
                      if not math.isfinite(y)})
        lines = []
        for label, key, points in series:
            xs, ys = zip(*points)
            ys = [y if math.isfinite(y) else math.nan for y in ys]  # NaN breaks the line: no straight line across
            # markers on short series, and on any with gaps: a value between two NaNs has no line to show it
            marker = "o" if len(points) <= 30 else ("." if any(math.isnan(y) for y in ys) else None)
            lines += ax.plot(xs, ys, label=label, color=color_of[label], marker=marker, markersize=3, linewidth=1.4)
        if odd:
            shown = ", ".join(map(str, odd[:6])) + (", ..." if len(odd) > 6 else "")
            title = f"{title} (NaN/inf at step {shown}: gaps)"
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
        if len(series) > 1 or len(labels) > 1:
            # handles and labels given: matplotlib would leave out a run whose name starts with "_"
            ax.legend(lines, [line.get_label() for line in lines], fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(" vs ".join(labels) if len(labels) <= 4 else f"{len(labels)} runs", fontsize=11)
    fig.tight_layout()
    target = _output_path(paths, out)
    png = io.BytesIO()
    try:
        fig.savefig(png, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    with atomic_open(target) as f:  # a failed write leaves the previous PNG as it was
        f.buffer.write(png.getvalue())
    return [target]
