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
untrusted: every string is passed through :func:`html.escape` (``quote=True``) before it is
written, file names and CSS classes are generated here and never taken from the data, and each
page carries a Content-Security-Policy that forbids scripts altogether. Unicode bidirectional
controls in that text are shown as a marked ``<U+202E>`` instead of acting: left to act they
reorder what is displayed ("Trojan Source"), so a reply could read as something it is not.

A re-run removes the pages it wrote earlier for steps (or trajectories) the run no longer has,
and nothing else: only files named and headed as this module names and heads its pages.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ragen.config import written_by_ragen
from ragen.files import file_in_the_way, write_text_atomic
from ragen.viz.frames import Frames, read_run_config, replay_frames

__all__ = ["build_site", "serve", "split_response", "parse_grid", "read_jsonl"]

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

# Grid envs: symbol -> (css class, legend label). Class names are fixed here, never from data.
GRID_ENVS: dict[str, dict[str, tuple[str, str]]] = {
    "sokoban": {
        "#": ("sk-wall", "wall"),
        "_": ("sk-floor", "floor"),
        "O": ("sk-target", "target"),
        "X": ("sk-box", "box"),
        "√": ("sk-boxok", "box on target"),
        "P": ("sk-player", "player"),
        "S": ("sk-playerok", "player on target"),
    },
    "frozen_lake": {
        "P": ("fl-player", "player"),
        "_": ("fl-ice", "frozen ice"),
        "O": ("fl-hole", "hole"),
        "G": ("fl-goal", "goal"),
        "X": ("fl-dead", "player in a hole"),
        "√": ("fl-won", "player on the goal"),
    },
}

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.2em auto;max-width:1200px;
     padding:0 1em;color:#222;background:#fff}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.4em}h3{font-size:1em;margin:.6em 0 .3em}
a{color:#0645ad}
nav{margin-bottom:1em;font-size:.9em}nav a{margin-right:1em}
table.data{border-collapse:collapse;font-size:.85em}
table.data th,table.data td{border:1px solid #ccc;padding:3px 7px;text-align:right}
table.data th{background:#f3f3f3;position:sticky;top:0}
table.data td.l,table.data th.l{text-align:left}
tr.ok td.succ{color:#1a7f37;font-weight:600}tr.fail td.succ{color:#b42318}
pre{white-space:pre-wrap;word-break:break-word;background:#f7f7f7;border:1px solid #e3e3e3;
    padding:.5em;margin:.3em 0;font-size:.85em}
pre.think{background:#f5f3ff;border-color:#ddd6fe}pre.answer{background:#ecfdf3;border-color:#abefc6}
.meta{font-size:.9em;color:#444}.meta b{color:#222}
.turn{border:1px solid #ddd;border-radius:6px;padding:.6em .8em;margin:.8em 0}
.turn-head{font-weight:600;margin-bottom:.3em}
.bad{color:#b42318;font-weight:600}.good{color:#1a7f37;font-weight:600}
.frame{display:flex;gap:1.2em;align-items:flex-start;flex-wrap:wrap}
table.grid{border-collapse:collapse;margin:.3em 0}
table.grid td{width:26px;height:26px;padding:0;text-align:center;font:bold 13px monospace;
              border:1px solid rgba(0,0,0,.15)}
.legend{font-size:.8em;line-height:1.8}
.legend span.sw{display:inline-block;width:14px;height:14px;vertical-align:middle;
                border:1px solid rgba(0,0,0,.25);margin:0 4px 0 10px}
.sk-wall{background:#4b4b4b;color:#bbb}.sk-floor{background:#ece6d8;color:#b9b1a0}
.sk-target{background:#ece6d8;color:#d4380d;box-shadow:inset 0 0 0 3px #fa8c16}
.sk-box{background:#a0632f;color:#fff}.sk-boxok{background:#2f9e44;color:#fff}
.sk-player{background:#1c7ed6;color:#fff}.sk-playerok{background:#1c7ed6;color:#fff;box-shadow:inset 0 0 0 3px #fa8c16}
.fl-player{background:#e8590c;color:#fff}.fl-ice{background:#d0ebff;color:#74a9cf}
.fl-hole{background:#1b1f3b;color:#8f96c9}.fl-goal{background:#fcc419;color:#5c3c00}
.fl-dead{background:#7a0c0c;color:#fff}.fl-won{background:#2f9e44;color:#fff}
.unk{background:#fff;color:#c00}
img.render{image-rendering:pixelated;border:1px solid #ccc;margin:.3em 0;display:block}
p.note{color:#8a5a00;font-style:italic}
.tokens{font:12px/1.7 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;
        word-break:break-all;border:1px solid #e3e3e3;padding:.5em}
.tokens span{border-radius:2px;box-shadow:inset -1px 0 rgba(0,0,0,.13)}
.tokens span.m{color:#9a9a9a;background:#f1f1f1}
.tokens span.z{background:#fff;outline:1px dotted #c8c8c8}
div.allm{min-width:24em;max-width:48em;white-space:normal}div.allm p{margin:.2em 0}
""" + "".join(
    # Advantage buckets: p1..p8 green (positive), n1..n8 red (negative), stronger = larger |A|.
    f".tokens span.p{i},.legend span.p{i}{{background:rgba(34,160,70,{0.12 + 0.11 * (i - 1):.2f})}}"
    f".tokens span.n{i},.legend span.n{i}{{background:rgba(220,50,47,{0.12 + 0.11 * (i - 1):.2f})}}"
    for i in range(1, 9)
) + ".legend span.m{background:#f1f1f1}.legend span.z{background:#fff;outline:1px dotted #c8c8c8}\n" + (
    # Last, so it wins over `.tokens span` when a token holds one.
    "span.bidi{color:#b42318;background:#fff1f0;border:1px solid #ffa39e;border-radius:2px;box-shadow:none;"
    "font:bold .8em ui-monospace,monospace;padding:0 1px}\n"
)

N_BUCKETS = 8

_THINK_RE = re.compile(r"<\s*think\s*>(.*?)(?:<\s*/\s*think\s*>|(?=<\s*answer\s*>)|\Z)", re.IGNORECASE | re.DOTALL)
_ANSWER_RE = re.compile(r"<\s*answer\s*>(.*?)(?:<\s*/\s*answer\s*>|\Z)", re.IGNORECASE | re.DOTALL)
_STEP_FILE_RE = re.compile(r"step_(\d+)\.jsonl")  # the whole name (fullmatch): not a backup_step_1.jsonl
# What this module writes into the output dir (fullmatch, then checked against the namer: see _generated_number).
_STEP_PAGE_RE = re.compile(r"step_(\d+)\.html")
_STEP_DIR_RE = re.compile(r"step_(\d+)")
_TRAJ_PAGE_RE = re.compile(r"traj_(\d+)\.html")

# Unicode bidirectional controls (the "Trojan Source" set): ALM, LRM, RLM, the embeddings/overrides LRE..RLO and the
# isolates LRI..PDI. Each only steers how the text around it is displayed; none is a letter, so showing it as a
# marker loses nothing, while Arabic or Hebrew letters (which carry their own direction) are left as they are.
_BIDI_RE = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _write_page(path: Path, text: str) -> None:
    """Write a page atomically (a browser or ``--serve`` reading it during a re-run gets the old page or the new one,
    never half of one); what UTF-8 cannot hold (lone surrogates: a non-UTF-8 file name, broken env text) becomes ``?``."""
    write_text_atomic(path, text.encode("utf-8", "replace").decode("utf-8"))


def _bidi_marker(char: str) -> str:
    """A bidi control as inert, escaped text: ``&lt;U+202E&gt;``."""
    return f"&lt;U+{ord(char):04X}&gt;"


def e(value: Any) -> str:
    """HTML-escape anything (attribute-safe); bidi controls become a plain ``<U+202E>`` marker.

    Plain text and no markup, so the result is safe inside an attribute or ``<title>`` too; :func:`e_text` adds the
    highlight where the text is element content.
    """
    escaped = html.escape("" if value is None else str(value), quote=True)
    return _BIDI_RE.sub(lambda m: _bidi_marker(m.group()), escaped)


def e_text(value: Any) -> str:
    """:func:`e` for element content: each bidi control marker is also highlighted, so it cannot pass for text.

    The highlight is what tells a real control from a model that merely wrote the characters ``<U+202E>``.
    """
    escaped = html.escape("" if value is None else str(value), quote=True)
    return _BIDI_RE.sub(lambda m: f"<span class='bidi' title='bidi control'>{_bidi_marker(m.group())}</span>", escaped)


# ----------------------------------------------------------------------------- reading


def read_jsonl(path: Path) -> Iterator[dict]:
    """The JSON objects of a JSONL file; blank, malformed and non-object lines are skipped."""
    try:
        handle = open(path, encoding="utf-8-sig", errors="replace")
    except OSError:
        return
    with handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, str):
        try:  # "--3", "²" or 5000 digits pass a str test but are no step
            return int(value.strip())
        except ValueError:
            return None
    return None


def json_number(value: Any) -> float | None:
    """A JSON number (or bool) as a float, NaN and ±inf kept, an int past float range as ±inf; else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # more digits than a float holds
            return math.inf if value > 0 else -math.inf
    if isinstance(value, float):
        return value
    return None


def _as_float(value: Any) -> float | None:
    """:func:`json_number`, and a number written as a string."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return json_number(value)


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


# ----------------------------------------------------------------------------- formatting


def fmt(value: Any) -> str:
    """A metric or reward value as escaped display text."""
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return e(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return e(value)
        return e(f"{value:.4g}")
    return e(value)


def split_response(response: Any) -> tuple[str | None, str | None]:
    """``(think, answer)`` parsed tolerantly from a response; ``None`` where a part is missing.

    Case- and whitespace-insensitive tags; an unclosed tag runs to the end (a ``<think>`` left open
    stops at an ``<answer>``); the first occurrence of each wins.
    """
    text = response if isinstance(response, str) else ("" if response is None else str(response))
    think = _THINK_RE.search(text)
    answer = _ANSWER_RE.search(text)
    return (think.group(1).strip() if think else None, answer.group(1).strip() if answer else None)


def _grid_kind(env: Any) -> str | None:
    name = str(env or "").lower().replace("-", "_").replace(" ", "_")
    if "sokoban" in name:
        return "sokoban"
    if "frozen" in name or "lake" in name:
        return "frozen_lake"
    return None


def parse_grid(text: Any, symbols: Iterable[str]) -> list[str] | None:
    """The first block of >= 2 equal-length lines made only of ``symbols``; ``None`` if there is none."""
    if not isinstance(text, str):
        return None
    allowed = set(symbols)
    block: list[str] = []
    for raw in text.splitlines() + [""]:
        line = raw.strip()
        ok = bool(line) and set(line) <= allowed
        if ok and block and len(line) == len(block[0]):
            block.append(line)
            continue
        if len(block) >= 2 and len(block[0]) >= 2:
            return block
        block = [line] if ok else []
    return None


def render_frame(observation: Any, env: Any, legend: bool = True, image: str = "") -> str:
    """An env observation: a coloured grid (+ legend) for grid envs, else escaped text.

    ``image``: HTML placed first (the rendered frame or a note; built by :func:`_image_html`).
    """
    if observation is None:
        observation = ""
    text = observation if isinstance(observation, str) else json.dumps(observation, ensure_ascii=False)
    kind = _grid_kind(env)
    grid = parse_grid(text, GRID_ENVS[kind]) if kind else None
    if grid is None:
        pre = f"<pre class='obs'>{e_text(text)}</pre>"
        return f"<div class='frame'><div>{image}</div><div>{pre}</div></div>" if image else pre
    palette = GRID_ENVS[kind]
    rows = []
    for line in grid:
        cells = "".join(
            f"<td class='{palette[ch][0]}' title='{e(palette[ch][1])}'>{e(ch)}</td>" for ch in line
        )
        rows.append(f"<tr>{cells}</tr>")
    table = f"<table class='grid'>{''.join(rows)}</table>"
    rest = "\n".join(line for line in text.splitlines() if line.strip() not in grid).strip()
    extra = f"<details><summary>text</summary><pre class='obs'>{e_text(text)}</pre></details>" if rest else ""
    side = _grid_legend(kind) if legend else ""
    first = f"<div>{image}</div>" if image else ""
    return f"<div class='frame'>{first}<div>{table}</div><div class='legend'>{side}{extra}</div></div>"


def _image_html(frames: Frames | None, position: int, env: Any) -> str:
    """The rendered frame at ``position`` (0 = initial, k = after turn k) as an <img>, or the replay note there."""
    if frames is None:
        return ""
    uri = frames.initial if position == 0 else (frames.turns[position - 1] if position <= len(frames.turns) else None)
    if uri is not None:
        # The URI is ours (base64 of our own PNG bytes); escaped anyway.
        return f"<img class='render' src='{e(uri)}' alt='{e(f'rendered {env} frame')}'>"
    if frames.note and frames.note_at == position:
        return f"<p class='meta note'>No rendered frame: {e_text(frames.note)}</p>"
    return ""


def _grid_legend(kind: str) -> str:
    items = [
        f"<span class='sw {cls}'></span>{e(sym)} {e(label)}" for sym, (cls, label) in GRID_ENVS[kind].items()
    ]
    return "<br>".join(items)


def _bucket(adv: float, scale: float) -> int:
    if scale <= 0:
        return 0
    return max(1, min(N_BUCKETS, math.ceil(abs(adv) / scale * N_BUCKETS)))


def _adv_scale(trajectories: Iterable[dict]) -> float:
    """Largest |advantage| on a trained token across the trajectories (the colour scale)."""
    scale = 0.0
    for traj in trajectories:
        if traj.get("in_update") is False:
            continue
        mask = traj.get("loss_mask") or []
        advs = traj.get("advantages") or []
        if not isinstance(mask, list) or not isinstance(advs, list):
            continue
        for m, a in zip(mask, advs):
            value = _as_float(a)
            if m and value is not None and math.isfinite(value):
                scale = max(scale, abs(value))
    return scale


def _token_html(i: int, token: Any, mask: list, advs: list, left_out: bool, scale: float) -> str:
    """Token ``i`` of the episode as a span: greyed if masked, else coloured by its advantage, with a tooltip."""
    trained = bool(mask[i]) if i < len(mask) else False
    adv = _as_float(advs[i]) if i < len(advs) else None
    if trained and left_out:
        cls, tip = "m", f"#{i} written by the model; this episode was left out of the update"
    elif not trained:
        cls, tip = "m", f"#{i} not trained (prompt/env)"
    elif adv is None or not math.isfinite(adv):  # the log writes NaN and inf as null
        cls, tip = "unk", f"#{i} trained, advantage not a number ({advs[i] if i < len(advs) else None!r})"
    else:
        b = _bucket(adv, scale) if adv != 0 else 0
        cls = "z" if b == 0 else ("p" if adv > 0 else "n") + str(b)
        tip = f"#{i} advantage {adv:+.4f}"
    return f"<span class='{cls}' title='{e(tip)}'>{e_text(token)}</span>"


def _token_lists(traj: dict) -> tuple[list, list, list, bool]:
    """``(tokens, loss_mask, advantages, left_out)`` of a record, each list ``[]`` when missing or malformed."""
    tokens = traj.get("tokens") if isinstance(traj.get("tokens"), list) else []
    mask = traj.get("loss_mask") if isinstance(traj.get("loss_mask"), list) else []
    advs = traj.get("advantages") if isinstance(traj.get("advantages"), list) else []
    return tokens, mask, advs, traj.get("in_update") is False  # filtered out or ended with an env error


def render_tokens(traj: dict, scale: float) -> str:
    """Every token as a span: greyed if masked, else coloured by its advantage, with a tooltip."""
    tokens, mask, advs, left_out = _token_lists(traj)
    if not tokens:
        return "<p class='meta'>No tokens recorded.</p>"
    spans = [_token_html(i, token, mask, advs, left_out, scale) for i, token in enumerate(tokens)]
    return f"<div class='tokens'>{''.join(spans)}</div>"


def _window_setting(traj: dict, run_config: dict | None) -> tuple[bool, Any]:
    """``(windowed, max_context_window)``: whether the episode was played with ``agent.context_mode=window``.

    The mode is run-wide (``config.yaml``); a record that carries ``window_prompts`` was windowed whatever the config.
    """
    agent = run_config.get("agent") if isinstance(run_config, dict) else None
    agent = agent if isinstance(agent, dict) else {}
    prompts = traj.get("window_prompts")
    windowed = agent.get("context_mode") == "window" or (isinstance(prompts, list) and bool(prompts))
    return windowed, agent.get("max_context_window")


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _turn_token_spans(traj: dict, n_tokens: int, n_turns: int) -> list[tuple[int, int]] | None:
    """Where each turn's sampled tokens sit in ``tokens``: the record's ``turn_spans`` when it has valid ones, else
    the runs of ``loss_mask = 1`` when there is exactly one per turn; None when neither says."""
    spans = traj.get("turn_spans")
    if isinstance(spans, list) and spans and all(
        isinstance(x, list) and len(x) == 2 and _is_index(x[0]) and _is_index(x[1]) and 0 <= x[0] <= x[1] <= n_tokens
        for x in spans
    ):
        return [(x[0], x[1]) for x in spans]
    _, mask, _, _ = _token_lists(traj)
    runs: list[tuple[int, int]] = []
    for i in range(min(len(mask), n_tokens)):
        if mask[i] and (i == 0 or not mask[i - 1]):
            runs.append((i, i + 1))
        elif mask[i]:
            runs[-1] = (runs[-1][0], i + 1)
    return runs if runs and len(runs) == n_turns else None


def _window_rows(traj: dict, scale: float, n_turns: int) -> str:
    """Each turn's training row in ``window`` mode, in a <details>: its window prompt (what the model saw, grey) and
    the tokens it sampled (coloured by advantage); "" when the record has no window prompts."""
    prompts = traj.get("window_prompts")
    if not isinstance(prompts, list) or not prompts:
        return ""
    tokens, mask, advs, left_out = _token_lists(traj)
    spans = _turn_token_spans(traj, len(tokens), n_turns)
    out = []
    for k, prompt in enumerate(prompts):
        if isinstance(prompt, list):
            size = f"{len(prompt)} tokens"
            seen = "".join(
                f"<span class='m' title='{e(f'turn {k + 1} window prompt #{j}: what the model saw, not trained')}'>"
                f"{e_text(piece)}</span>"
                for j, piece in enumerate(prompt)
            )
        elif isinstance(prompt, str):
            size = f"{len(prompt)} characters"
            seen = f"<span class='m' title='turn {k + 1} window prompt'>{e_text(prompt)}</span>"
        else:
            out.append(f"<p class='meta'>Turn {k + 1}: window prompt not recorded.</p>")
            continue
        if spans is not None and k < len(spans):
            start, end = spans[k]
            answer = "".join(_token_html(i, tokens[i], mask, advs, left_out, scale) for i in range(start, end))
            what = f"window prompt ({size}) + the {end - start} tokens the model sampled: the row trained for this turn"
        else:
            answer = ""
            what = f"window prompt ({size}); where its answer sits in the episode is not recorded"
        out.append(f"<details><summary>Turn {k + 1}: {e(what)}</summary>"
                   f"<div class='tokens'>{seen}{answer}</div></details>")
    return "".join(out)


def _tokens_section(traj: dict, scale: float, run_config: dict | None, n_turns: int) -> str:
    """The page's Tokens section; in ``window`` mode it says what the model saw and shows each turn's window."""
    legend = _token_legend(scale)
    windowed, window = _window_setting(traj, run_config)
    if not windowed:
        return "<h2>Tokens</h2>" + legend + render_tokens(traj, scale)
    size = f" (<code>agent.max_context_window={e_text(window)}</code>)" if window is not None else ""
    last = (f"at most the last {e_text(window)} turn{'' if window == 1 else 's'}" if window is not None
            else "only the last turns")
    note = (
        f"<p class='note'>This run used <code>agent.context_mode=window</code>{size}: the model answered each turn "
        f"from that turn's own window prompt (the system prompt, the env's rules and answer format, {last}, "
        "a past answer as its chat text, and the current observation), and each turn was trained as its own "
        "row: its window prompt + the tokens it sampled (docs/context_modes.md). The whole-episode sequence further "
        "down is the full history the log records: its coloured tokens are the model's own, with the advantages they "
        "were trained with, but after the first turn its grey context is <b>not</b> what the model saw.</p>"
    )
    rows = _window_rows(traj, scale, n_turns)
    if rows:
        rows = "<h3>What the model saw and was trained on, turn by turn</h3>" + rows
    else:
        rows = ("<p class='meta'>This rollout log does not record the turns' window prompts (no "
                "<code>window_prompts</code> in the record), so what the model saw for each turn cannot be shown "
                "here.</p>")
    return ("<h2>Tokens</h2>" + note + legend + rows
            + "<h3>Whole episode (the full history: not a sequence the model saw)</h3>" + render_tokens(traj, scale))


def _token_legend(scale: float) -> str:
    parts = ["<span class='sw m'></span>not trained (prompt, template, env text)",
             "<span class='sw z'></span>trained, advantage 0"]
    if scale > 0:
        lo = [f"<span class='sw n{i}'></span>" for i in range(N_BUCKETS, 0, -1)]
        hi = [f"<span class='sw p{i}'></span>" for i in range(1, N_BUCKETS + 1)]
        parts.append(
            f"advantage {e(f'{-scale:.3g}')} {''.join(lo)} 0 {''.join(hi)} {e(f'+{scale:.3g}')}"
            " (scale: largest |A| in this step; hover a token for its value)"
        )
    return "<div class='legend'>" + " &middot; ".join(parts) + "</div>"


# ----------------------------------------------------------------------------- pages


# How every page starts (up to the CSP, which may change between versions): what marks a file as one of ours.
_PAGE_HEAD = "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><meta http-equiv='Content-Security-Policy'"


def _page(title: str, body: str, nav: str = "") -> str:
    return (
        f"{_PAGE_HEAD} content=\"{CSP}\">"
        "<meta name='referrer' content='no-referrer'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        f"<title>{e(title)}</title><style>{CSS}</style></head><body>"
        f"<nav>{nav}</nav>{body}</body></html>\n"
    )


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
