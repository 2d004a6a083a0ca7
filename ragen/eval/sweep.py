"""``ragen sweep``: train one preset on several seeds and print what each seed's validation did.

Each seed runs ``ragen train PRESET seed=S`` in its own process and run dir (``OUT/seed_S``); a seed whose run dir
already holds a finished run (``summary.json`` with a final validation) is read, not run again, so an interrupted
sweep continues where it stopped. The table gives, per seed, validation success before and after training on every
tag, the gain, the env's own ``info_*`` numbers at the end (Bandit's ``info_second_listed``: 0 or 1 is a position
habit) and the collapse warnings the run printed; below it, the mean gain over seeds with its 95 % Student-t interval.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ragen.envs.registry import habit_metric_names
from ragen.eval.collapse import CollapseMonitor
from ragen.eval.intervals import mean_interval

#: What every sweep run is told on top of the user's overrides: no weights saved, no progress bar, no plot.
RUN_DEFAULTS = ("trainer.save_final=false", "trainer.progress_bar=false", "trainer.plot=false")


@dataclass
class SeedResult:
    """One seed's run, read from its run dir."""

    seed: int
    #: ``val/<tag>/success`` (and ``all``) before and after training.
    before: dict[str, float]
    after: dict[str, float]
    #: ``val/<tag>/info_<name>`` after training, by ``"<tag>/<name>"``.
    info_after: dict[str, float] = field(default_factory=dict)
    warnings: int = 0
    wall_time_s: float = math.nan

    @property
    def gain(self) -> float:
        return self.after["all"] - self.before["all"]


def parse_seeds(text: str) -> list[int]:
    """``"0-7"``, ``"0,2,5"`` or ``"0-3,8"`` → the seeds, in order, each once."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise ValueError(f"--seeds: {part!r} is not a seed or a range like 0-7") from None
        if first < 0 or last < first:
            raise ValueError(f"--seeds: {part!r} is not a range of non-negative seeds")
        seeds += [s for s in range(first, last + 1) if s not in seeds]
    if not seeds:
        raise ValueError("--seeds names no seed")
    return seeds


def _validation(row: dict) -> tuple[dict[str, float], dict[str, float]]:
    """``({tag: success}, {"tag/name": info})`` of one logged validation (``all`` for the whole set)."""
    success, info = {}, {}
    for key, value in row.items():
        parts = key.split("/")
        if parts[0] != "val" or value is None:
            continue
        if len(parts) == 2 and parts[1] == "success":
            success["all"] = value
        elif len(parts) == 3 and parts[2] == "success":
            success[parts[1]] = value
        elif len(parts) == 3 and parts[2].startswith("info_"):
            info[f"{parts[1]}/{parts[2][5:]}"] = value
        elif len(parts) == 2 and parts[1].startswith("info_"):
            info[f"all/{parts[1][5:]}"] = value
    return success, info


def read_run(run_dir: Path, seed: int) -> SeedResult:
    """The first and last validation of a finished run, its collapse warnings (the monitor replayed over its metrics)
    and its wall time; ``ValueError`` when the run has no validation before and after training."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    validations = [row for row in rows if any(k.startswith("val/") for k in row)]
    if len(validations) < 2 or validations[0].get("step") != 0:
        raise ValueError(f"{run_dir}: no validation before and after training in metrics.jsonl")
    before, _ = _validation(validations[0])
    after, info = _validation(validations[-1])
    monitor = CollapseMonitor(habit_metrics=habit_metric_names())
    warnings = sum(len(monitor.check({k: math.nan if v is None else v for k, v in row.items()}))
                   for row in rows if row.get("step", 0) > 0 and "actor/entropy" in row)
    summary_path = run_dir / "summary.json"
    wall = json.loads(summary_path.read_text()).get("wall_time_s", math.nan) if summary_path.exists() else math.nan
    return SeedResult(seed, before, after, info, warnings, wall)


def finished(run_dir: Path) -> bool:
    summary = run_dir / "summary.json"
    if not summary.exists():
        return False
    try:
        return "val_after" in json.loads(summary.read_text())
    except ValueError:
        return False


def run_seed(preset: str, seed: int, run_dir: Path, overrides: list[str], log) -> int:
    """Train ``preset`` on ``seed`` into ``run_dir`` in a child process (its output to ``run_dir``.log); the exit status."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "ragen.cli", "train", preset, f"seed={seed}", f"trainer.output_dir={run_dir}",
               *RUN_DEFAULTS, *overrides]
    log(f"[sweep] seed {seed}: {' '.join(command[2:])}")
    with open(run_dir.with_suffix(".log"), "w") as out:
        return subprocess.call(command, stdout=out, stderr=subprocess.STDOUT)


def format_table(results: list[SeedResult]) -> str:
    """A Markdown table, a row per seed, and the mean gain with its 95 % interval over seeds."""
    tags = [t for t in results[0].before if t != "all"]
    infos = sorted({k for r in results for k in r.info_after if not k.startswith("all/")})
    head = ["seed", "start", "end", "gain", *(f"{t} start→end" for t in tags), *(f"{k} (end)" for k in infos),
            "warnings", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in results:
        cells = [str(r.seed), f"{r.before['all']:.3f}", f"{r.after['all']:.3f}", f"{r.gain:+.3f}"]
        cells += [f"{r.before.get(t, math.nan):.3f} → {r.after.get(t, math.nan):.3f}" for t in tags]
        cells += [f"{r.info_after.get(k, math.nan):.2f}" for k in infos]
        cells += [str(r.warnings), f"{r.wall_time_s:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    gains = [r.gain for r in results]
    mean, low, high = mean_interval(gains)
    lines.append(f"all: mean gain {mean:+.3f} ({interval_text(low, high)}, {len(gains)} seed{'s' if len(gains) > 1 else ''}), "
                 f"min {min(gains):+.3f}, mean end {sum(r.after['all'] for r in results) / len(results):.3f}")
    for tag in tags:
        tag_gains = [r.after[tag] - r.before[tag] for r in results if tag in r.after and tag in r.before]
        if tag_gains:
            mean, low, high = mean_interval(tag_gains)
            lines.append(f"{tag}: mean gain {mean:+.3f} ({interval_text(low, high)}), min {min(tag_gains):+.3f}")
    for key in infos:
        values = [r.info_after[key] for r in results if key in r.info_after]
        lines.append(f"{key} at the end: {min(values):.2f} to {max(values):.2f}")
    return "\n".join(lines)


def sweep(preset: str, seeds: list[int], out: Path, overrides: list[str], log=print) -> list[SeedResult]:
    """Run (or read) every seed's run and return the results; a failed run is reported and left out."""
    results = []
    for seed in seeds:
        run_dir = out / f"seed_{seed}"
        if not finished(run_dir):
            if run_dir.exists():
                raise FileExistsError(f"{run_dir} holds an unfinished run: remove it to run seed {seed} again")
            start = time.perf_counter()
            status = run_seed(preset, seed, run_dir, overrides, log)
            if status != 0:
                log(f"[sweep] seed {seed}: exit status {status} (see {run_dir.with_suffix('.log')}); left out")
                continue
            log(f"[sweep] seed {seed}: done in {time.perf_counter() - start:.0f} s")
        results.append(read_run(run_dir, seed))
    return results


def interval_text(low: float, high: float) -> str:
    """``95 % CI low to high``, or that one seed gives no interval."""
    if math.isnan(low):
        return "no interval from one seed"
    return f"95 % CI {low:+.3f} to {high:+.3f}"
