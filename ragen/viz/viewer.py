"""A static HTML viewer for a training run: ``ragen view RUN_DIR``.

Reads what the trainer writes into a run directory::

    RUN_DIR/metrics.jsonl                 one JSON object per line (``step`` + metric keys)
    RUN_DIR/config.yaml                   the resolved config
    RUN_DIR/rollouts/step_000003.jsonl    one JSON object per trajectory

and writes a self-contained site (no server, no external assets, no JavaScript)::

    OUT/index.html                        steps with their metrics
    OUT/step_000003.html                  the step's trajectories
    OUT/step_000003/traj_0000.html        one trajectory: frames, think/answer, actions,
                                          rewards, tokens coloured by advantage

Sokoban and FrozenLake trajectories also get the env's rendered RGB frame at the start and
after every turn, as PNG data URIs, from replaying the recorded actions
(:mod:`ragen.viz.frames`; a frame is shown only when the replay reproduces the recorded
observation).

Everything in a rollout (model text, decoded tokens, observations, even env names) is
untrusted: every string is passed through :func:`ragen.viz.page.e` (``html.escape``, ``quote=True``) before it is
written, file names and CSS classes are generated here and never taken from the data, and each
page carries a Content-Security-Policy that forbids scripts altogether. Unicode bidirectional
controls in that text are shown as a marked ``<U+202E>`` instead of acting: left to act they
reorder what is displayed ("Trojan Source"), so a reply could read as something it is not.

A re-run removes the pages it wrote earlier for steps (or trajectories) the run no longer has,
and nothing else: only files named and headed as this module names and heads its pages.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable

from ragen.config import written_by_ragen
from ragen.files import file_in_the_way
from ragen.viz.frames import read_run_config, replay_frames
from ragen.viz.episode_html import _adv_scale, _image_html, _tokens_section, render_frame, split_response
from ragen.viz.page import _PAGE_HEAD, _as_int, _page, _write_page, e_text, fmt, read_jsonl

__all__ = ["build_site", "serve"]

# Metrics shown on the index page first, in this order, when logged: what tells how a run goes (validation, then
# training success and reward, answer format, entropy, grad norm, the KL terms), then length and step time.
INDEX_METRICS = (
    "val/success",
    "val/reward_mean",
    "train/success",
    "train/reward_mean",
    "train/format_valid",
    "actor/entropy",
    "actor/grad_norm",
    "actor/kl_loss",
    "actor/kl_in_reward",
    "actor/approx_kl",
    "train/response_length",
    "time/step_s",
)
# Up to this many other numeric metrics follow on the index (run-wide ones before per-tag ones such as
# ``train/sokoban/success``, then by name); every metric of a step is in its row's "all metrics" cell.
MAX_EXTRA_METRICS = 8
_STEP_FILE_RE = re.compile(r"step_(\d+)\.jsonl")  # the whole name (fullmatch): not a backup_step_1.jsonl
# What this module writes into the output dir (fullmatch, then checked against the namer: see _generated_number).
_STEP_PAGE_RE = re.compile(r"step_(\d+)\.html")
_STEP_DIR_RE = re.compile(r"step_(\d+)")
_TRAJ_PAGE_RE = re.compile(r"traj_(\d+)\.html")


def _metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """Merge every metrics line into one dict per step (later lines win per key)."""
    merged: dict[int, dict] = {}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        step = _as_int(row.get("step"))
        if step is None:
            continue
        merged.setdefault(step, {}).update({k: math.nan if v is None else v for k, v in row.items()})  # null: NaN/inf
    return merged


def _rollout_files(run_dir: Path) -> dict[int, Path]:
    files: dict[int, Path] = {}
    folder = run_dir / "rollouts"
    if folder.is_dir():
        for path in folder.iterdir():
            match = _STEP_FILE_RE.fullmatch(path.name)
            if match and path.is_file():
                files[int(match.group(1))] = path
    return files


def _step_name(step: int) -> str:
    return f"step_{step:06d}"


def _metric_order(key: str) -> tuple:
    """Sort key: :data:`INDEX_METRICS` in their order, then run-wide metrics before per-tag ones, then by name."""
    if key in INDEX_METRICS:
        return (0, INDEX_METRICS.index(key), 0, "")
    return (1, 0, key.count("/"), key)


def _metric_keys(metrics: dict) -> list[str]:
    """A step's metric keys that have a value to show (not ``step``, not a nested object), in display order."""
    return sorted((k for k, v in metrics.items() if k != "step" and not isinstance(v, (dict, list))), key=_metric_order)


def _all_metrics(metrics: dict) -> str:
    """Every metric of a step as ``name value`` text (escaped); "" when it has none."""
    keys = _metric_keys(metrics)
    if not keys:
        return ""
    return "<p class='meta'>" + " &middot; ".join(f"<b>{e_text(k)}</b> {fmt(metrics[k])}" for k in keys) + "</p>"


def _index_keys(metrics: dict[int, dict]) -> tuple[list[str], list[str]]:
    """``(shown, not_shown)``: the index table's metric columns, and every other logged metric key.

    The columns are :data:`INDEX_METRICS` that were logged, in that order, then up to :data:`MAX_EXTRA_METRICS` other
    numeric metrics (run-wide before per-tag, then by name). Every metric, shown or not, is in each row's "all metrics"
    cell and on the step's page.
    """
    logged = {k for m in metrics.values() for k in _metric_keys(m)}
    preferred = [k for k in INDEX_METRICS if k in logged]
    numeric = {
        k for m in metrics.values() for k, v in m.items()
        if k in logged and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    shown = preferred + sorted(numeric - set(preferred), key=_metric_order)[:MAX_EXTRA_METRICS]
    return shown, sorted(logged - set(shown), key=_metric_order)


def _index_page(run_dir: Path, metrics: dict[int, dict], rollouts: dict[int, int]) -> str:
    steps = sorted(set(metrics) | set(rollouts))
    keys, not_shown = _index_keys(metrics)
    head = ("<th>step</th><th class='l'>trajectories</th><th class='l'>all metrics</th>"
            + "".join(f"<th>{e_text(k)}</th>" for k in keys))
    rows = []
    for step in steps:
        m = metrics.get(step, {})
        cells = "".join(f"<td>{fmt(m.get(k))}</td>" for k in keys)
        if step in rollouts:
            link = f"<a href='{_step_name(step)}.html'>{rollouts[step]} trajectories</a>"
        else:
            link = "<span class='meta'>none saved</span>"
        listed = _all_metrics(m)
        every = (f"<details><summary>{len(_metric_keys(m))}</summary><div class='allm'>{listed}</div></details>"
                 if listed else "")
        rows.append(f"<tr><td>{step}</td><td class='l'>{link}</td><td class='l'>{every}</td>{cells}</tr>")
    table = f"<table class='data'><tr>{head}</tr>{''.join(rows)}</table>" if rows else "<p>No steps logged yet.</p>"
    if not_shown:
        names = ", ".join(e_text(k) for k in not_shown)
        table = (
            f"<p class='meta'>The table shows {len(keys)} of the {len(keys) + len(not_shown)} logged metrics; "
            f"<b>{len(not_shown)} more metrics</b> are in each row's <i>all metrics</i> cell (open it), and on the "
            "step's page when its trajectories were saved.</p>"
            f"<details class='meta'><summary>the {len(not_shown)} metrics not in the table</summary>{names}</details>"
            f"{table}"
        )
    config = ""
    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        text = config_path.read_text(encoding="utf-8", errors="replace")
        config = f"<h2>Config</h2><details><summary>config.yaml</summary><pre>{e_text(text)}</pre></details>"
    body = (f"<h1>Run {e_text(run_dir.resolve().name)}</h1><p class='meta'>{e_text(run_dir.resolve())}</p>"
            f"{table}{config}")
    return _page(f"ragen run {run_dir.resolve().name}", body)


def _traj_name(index: int) -> str:
    return f"traj_{index:04d}.html"


def _generated_number(name: str, pattern: re.Pattern, namer: Callable[[int], str]) -> int | None:
    """The step or trajectory number in ``name`` if ``namer`` gives exactly that name back, else None.

    The round trip keeps names this module would never write (``step_3.html``, ``step_0000003.html``) out of reach.
    """
    match = pattern.fullmatch(name)
    if match is None:
        return None
    number = int(match.group(1))
    return number if namer(number) == name else None


def _is_our_page(path: Path) -> bool:
    """A regular file (not a link) that starts as :func:`_page` starts every page.

    ``--out`` may be any directory, so a name alone is not proof enough to delete a file.
    """
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as handle:
            return handle.read(len(_PAGE_HEAD)).decode("utf-8", "replace") == _PAGE_HEAD
    except OSError:
        return False


def _remove_stale_pages(out: Path, counts: dict[int, int]) -> None:
    """Remove the pages an earlier build wrote for steps or trajectories that ``counts`` (step -> trajectories) lacks.

    After rollout files are pruned, or a run restarts with fewer steps, those pages would stay reachable (bookmarks,
    an open tab, ``--serve``) and show steps the run no longer has. Only files with our names and our page head go;
    a step folder is removed only once nothing else is left in it.
    """
    for entry in sorted(out.iterdir()):
        if entry.is_symlink():
            continue  # never follow a link out of ``out``
        step = _generated_number(entry.name, _STEP_PAGE_RE, lambda n: f"{_step_name(n)}.html")
        if step is not None and step not in counts and _is_our_page(entry):
            entry.unlink()
        step = _generated_number(entry.name, _STEP_DIR_RE, _step_name)
        if step is not None and entry.is_dir():
            _remove_stale_traj_pages(entry, counts.get(step, 0))
            if step not in counts and not any(entry.iterdir()):
                entry.rmdir()  # emptied by us, or left empty by an earlier build of a step with no trajectories


def _remove_stale_traj_pages(folder: Path, count: int) -> None:
    """Remove ``folder``'s trajectory pages numbered ``count`` and up (the step now has ``count`` trajectories)."""
    for entry in sorted(folder.iterdir()):
        index = _generated_number(entry.name, _TRAJ_PAGE_RE, _traj_name)
        if index is not None and index >= count and _is_our_page(entry):
            entry.unlink()


def _succ(value: Any) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return fmt(value)


def _step_page(run_name: str, step: int, metrics: dict, trajectories: list[dict], prev_step, next_step) -> str:
    nav = ["<a href='index.html'>&larr; all steps</a>"]
    if prev_step is not None:
        nav.append(f"<a href='{_step_name(prev_step)}.html'>&lsaquo; step {prev_step}</a>")
    if next_step is not None:
        nav.append(f"<a href='{_step_name(next_step)}.html'>step {next_step} &rsaquo;</a>")
    summary = _all_metrics(metrics)
    summary = f"<h2>Metrics ({len(_metric_keys(metrics))})</h2>{summary}" if summary else ""
    rows = []
    for i, traj in enumerate(trajectories):
        turns = traj.get("turns") if isinstance(traj.get("turns"), list) else []
        success = traj.get("success")
        errored = bool(traj.get("error"))  # the env failed: no reward or success to judge the model by
        cls = "" if errored else ("ok" if success is True else ("fail" if success is False else ""))
        env = traj.get("env", "")
        shown = f"{env} ({traj['tag']})" if traj.get("tag") and traj.get("tag") != env else env
        rows.append(
            f"<tr class='{cls}'><td><a href='{_step_name(step)}/{_traj_name(i)}'>#{i}</a></td>"
            f"<td class='l'>{e_text(shown)}</td><td>{fmt(traj.get('group_id'))}</td>"
            f"<td>{fmt(traj.get('seed'))}</td><td>{'&ndash;' if errored else fmt(traj.get('reward'))}</td>"
            f"<td class='succ'>{'env error' if errored else _succ(success)}</td><td>{len(turns)}</td>"
            f"<td class='l'>{e_text(traj.get('error') or '')}</td></tr>"
        )
    table = (
        "<table class='data'><tr><th>#</th><th class='l'>env</th><th>group</th><th>seed</th><th>reward</th>"
        "<th>success</th><th>turns</th><th class='l'>error</th></tr>" + "".join(rows) + "</table>"
    )
    body = f"<h1>{e_text(run_name)} &mdash; step {step}</h1>{summary}<h2>Trajectories ({len(rows)})</h2>{table}"
    return _page(f"{run_name} step {step}", body, " ".join(nav))


def _traj_page(run_name: str, step: int, index: int, count: int, traj: dict, scale: float,
               run_config: dict | None = None) -> str:
    env = traj.get("env", "")
    frames = replay_frames(traj, run_config)
    nav = [
        "<a href='../index.html'>&larr; all steps</a>",
        f"<a href='../{_step_name(step)}.html'>&uarr; step {step}</a>",
    ]
    if index > 0:
        nav.append(f"<a href='{_traj_name(index - 1)}'>&lsaquo; #{index - 1}</a>")
    if index + 1 < count:
        nav.append(f"<a href='{_traj_name(index + 1)}'>#{index + 1} &rsaquo;</a>")
    success = traj.get("success")
    meta = (
        f"<b>env</b> {e_text(env)} &middot; <b>group</b> {fmt(traj.get('group_id'))} &middot; "
        f"<b>seed</b> {fmt(traj.get('seed'))} &middot; <b>reward</b> {fmt(traj.get('reward'))} &middot; "
        f"<b>success</b> <span class='{'good' if success is True else 'bad'}'>{_succ(success)}</span>"
    )
    if traj.get("tag") and traj.get("tag") != env:
        meta = f"<b>tag</b> {e_text(traj.get('tag'))} &middot; " + meta
    if traj.get("error"):
        meta += f" &middot; <b>error</b> <span class='bad'>{e_text(traj.get('error'))}</span>"
    if traj.get("context_full"):
        meta += f" &middot; <b>ended at the model's context</b> {e_text(traj.get('context_full'))}"
    if traj.get("in_update") is False:
        meta += (" &middot; <b>left out of the update</b> (dropped by the uncertainty filter, an env error, no token "
                 "written, or the step's update skipped): its tokens are greyed")
    parts = [f"<h1>{e_text(run_name)} &mdash; step {step} &mdash; trajectory #{index}</h1><p class='meta'>{meta}</p>"]
    initial_image = _image_html(frames, 0, env)
    parts.append("<h2>Initial observation</h2>" + render_frame(traj.get("initial_observation", ""), env, image=initial_image))
    turns = traj.get("turns") if isinstance(traj.get("turns"), list) else []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            turn = {"response": turn}
        parts.append(_turn_html(t, turn, env, _image_html(frames, t + 1, env)))
    if not turns:
        parts.append("<p class='meta'>No turns recorded.</p>")
    parts.append(_tokens_section(traj, scale, run_config, len(turns)))
    return _page(f"{run_name} step {step} #{index}", "".join(parts), " ".join(nav))


def _turn_html(t: int, turn: dict, env: Any, image: str = "") -> str:
    response = turn.get("response", "")
    think, answer = split_response(response)
    actions = turn.get("actions")
    if isinstance(actions, list):
        actions_html = ", ".join(f"<code>{e_text(a)}</code>" for a in actions) or "<span class='bad'>none</span>"
    else:
        actions_html = f"<code>{e_text(actions)}</code>" if actions else "<span class='bad'>none</span>"
    valid = turn.get("format_valid")
    valid_html = "<span class='good'>valid</span>" if valid is True else (
        "<span class='bad'>invalid</span>" if valid is False else fmt(valid)
    )
    head = (
        f"<div class='turn-head'>Turn {t + 1}</div><p class='meta'><b>actions</b> {actions_html} &middot; "
        f"<b>format</b> {valid_html} &middot; <b>env reward</b> {fmt(turn.get('env_reward'))} &middot; "
        f"<b>format penalty</b> {fmt(turn.get('format_penalty'))}</p>"
    )
    body = []
    if think is not None:
        body.append(f"<h3>think</h3><pre class='think'>{e_text(think)}</pre>")
    if answer is not None:
        body.append(f"<h3>answer</h3><pre class='answer'>{e_text(answer)}</pre>")
    raw = response if isinstance(response, str) else json.dumps(response, ensure_ascii=False)
    if think is None and answer is None:
        body.append(f"<h3>response (no think/answer tags)</h3><pre>{e_text(raw)}</pre>")
    else:
        body.append(f"<details><summary>raw response</summary><pre>{e_text(raw)}</pre></details>")
    if "observation" in turn:
        body.append(
            "<h3>observation after this turn</h3>" + render_frame(turn.get("observation", ""), env, legend=False, image=image)
        )
    elif image:
        body.append(image)
    return f"<div class='turn'>{head}{''.join(body)}</div>"


# ----------------------------------------------------------------------------- entry points


def build_site(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Write the viewer for ``run_dir`` into ``out_dir`` (default ``RUN_DIR/viewer``); return index.html.

    Raises ``FileNotFoundError`` if ``run_dir`` is not a directory or holds no run (no ``metrics.jsonl``, no
    ``rollouts/`` and no ``config.yaml`` of a run that has just started), before writing anything.
    """
    run = Path(run_dir)
    if run.is_file():
        raise FileNotFoundError(f"{run} is a file; give the run directory that holds it ({run.parent})")
    if not run.is_dir():
        raise FileNotFoundError(f"run directory not found: {run}")
    if not ((run / "metrics.jsonl").is_file() or (run / "rollouts").is_dir() or written_by_ragen(run / "config.yaml")):
        raise FileNotFoundError(f"{run} holds no run to view (no metrics.jsonl, no rollouts/, no run's config.yaml); "
                                "give a run directory")
    out = Path(out_dir) if out_dir is not None else run / "viewer"
    in_the_way = file_in_the_way(out)
    if in_the_way is not None:
        raise FileExistsError(f"--out {out}: {in_the_way} is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    run_name = run.resolve().name
    metrics = _metrics_by_step(run)
    run_config = read_run_config(run)
    files = _rollout_files(run)
    steps = sorted(files)
    counts: dict[int, int] = {}
    for pos, step in enumerate(steps):
        trajectories = list(read_jsonl(files[step]))
        counts[step] = len(trajectories)
        scale = _adv_scale(trajectories)
        prev_step = steps[pos - 1] if pos > 0 else None
        next_step = steps[pos + 1] if pos + 1 < len(steps) else None
        page = _step_page(run_name, step, metrics.get(step, {}), trajectories, prev_step, next_step)
        _write_page(out / f"{_step_name(step)}.html", page)
        folder = out / _step_name(step)
        folder.mkdir(exist_ok=True)
        for i, traj in enumerate(trajectories):
            html_text = _traj_page(run_name, step, i, len(trajectories), traj, scale, run_config)
            _write_page(folder / _traj_name(i), html_text)
    index = out / "index.html"
    _write_page(index, _index_page(run, metrics, counts))
    _remove_stale_pages(out, counts)
    return index


def serve(directory: str | os.PathLike, port: int = 8000) -> None:  # pragma: no cover - interactive
    """Serve ``directory`` on http://127.0.0.1:PORT until interrupted."""
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
        print(f"serving {directory} at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C to stop)")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
