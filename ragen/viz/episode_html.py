"""One episode as HTML: grid observations as coloured boards, responses split into think and answer, and every
token coloured by its advantage (greyed where the model did not write it)."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable

from ragen.viz.frames import Frames
from ragen.viz.page import _as_float, e, e_text

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

N_BUCKETS = 8

_THINK_RE = re.compile(r"<\s*think\s*>(.*?)(?:<\s*/\s*think\s*>|(?=<\s*answer\s*>)|\Z)", re.IGNORECASE | re.DOTALL)
_ANSWER_RE = re.compile(r"<\s*answer\s*>(.*?)(?:<\s*/\s*answer\s*>|\Z)", re.IGNORECASE | re.DOTALL)


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
