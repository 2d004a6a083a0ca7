"""``ragen view``: a ``window``-mode episode's page says what the model saw (and shows each turn's window when the log
has it); the index puts the important metrics first and every other logged metric stays reachable."""

import html
import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from ragen.viz.viewer import INDEX_METRICS, MAX_EXTRA_METRICS, build_site

from tests.viz.test_viewer import ScriptedBackend

EVIL = "<script>alert(1)</script><img src=x onerror=\"document.title='PWNED'\">\u202e"
REPLIES = [
    "<think>first</think><answer>Up</answer>",
    "<think>second</think><answer>Left</answer>",
    "<think>third</think><answer>Down</answer>",
]


def _play(run: Path, tokenizer, overrides, log_windows=False, spans=True):
    """A run dir as the trainer writes it (config.yaml, one rollouts file) from a real Rollout.

    ``log_windows``: also log each turn's window prompt as decoded tokens (``window_prompts``) and, with ``spans``,
    ``turn_spans``, as the trainer's records carry them; without, a log written before they were recorded.
    """
    from ragen.agent import AgentConfig, Rollout
    from ragen.config import load_config, to_yaml
    from ragen.models.backend import SamplingParams
    from ragen.agent.env_sets import Slots, train_sets

    config = load_config("sokoban", ["rollout.env_groups=1", "rollout.group_size=1", "agent.max_turn=3", *overrides])
    slots = Slots.build(train_sets(config), config.rollout.group_size)
    rollout = Rollout(ScriptedBackend(tokenizer, REPLIES), tokenizer, AgentConfig(**asdict(config.agent)), SamplingParams())
    trajs = rollout.run(slots.envs, [5], [0], slots.env_names, settings=slots.settings, tags=slots.tags)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(to_yaml(config))
    records = []
    for t in trajs:
        n = len(t.input_ids)
        record = {"step": 1, **t.to_json(), "in_update": True, "tokens": [tokenizer.decode([i]) for i in t.input_ids],
                  "loss_mask": t.loss_mask, "advantages": [0.0] + [0.5] * (n - 1)}
        if log_windows:
            record["window_prompts"] = [[tokenizer.decode([i]) for i in p] for p in t.window_prompts]
            if spans:
                record["turn_spans"] = [list(s) for s in t.turn_spans]
        records.append(record)
    (run / "rollouts").mkdir(exist_ok=True)
    (run / "rollouts" / "step_000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/success": 0.0}) + "\n")
    return trajs, records


def _text(fragment: str) -> str:
    """What a browser shows for an HTML fragment (tags dropped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


WINDOW = ["agent.context_mode=window", "agent.max_context_window=1"]
FRAME_RE = re.compile(r"<img class='render' src='data:image/png;base64,[A-Za-z0-9+/=]+' alt='[^'<>]*'>")


def test_a_window_mode_page_says_the_model_saw_windows_not_the_whole_episode(tmp_path, tokenizer):
    """What the trainer logs today (no window prompts): the Tokens section must not pass the history off as the
    context the model saw; it says so and that the log lacks the windows."""
    run = tmp_path / "run"
    trajs, _ = _play(run, tokenizer, WINDOW)
    assert len(trajs[0].turns) == 3 and len(trajs[0].window_prompts) == 3  # a real windowed episode
    page = (build_site(run, tmp_path / "out").parent / "step_000001" / "traj_0000.html").read_text()
    tokens = page[page.index("<h2>Tokens</h2>"):]
    assert "<code>agent.context_mode=window</code>" in tokens and "agent.max_context_window=1" in tokens
    assert "at most the last 1 turn," in tokens
    assert "its grey context is <b>not</b> what the model saw" in tokens
    assert "does not record the turns' window prompts" in tokens
    assert "<h3>Whole episode (the full history: not a sequence the model saw)</h3>" in tokens
    # said before the sequence is shown
    assert tokens.index("<b>not</b> what the model saw") < tokens.index("<div class='tokens'>")


def test_window_prompts_in_the_log_are_shown_per_turn_as_the_rows_trained(tmp_path, tokenizer):
    """With ``window_prompts`` (and ``turn_spans``) in the record, each turn's <details> holds exactly
    ``window_prompts[k] + that turn's sampled ids``, decoded: the row the model saw and was trained on."""
    for spans in (True, False):  # without turn_spans the answer is found from loss_mask (one run per turn)
        run = tmp_path / f"run_{spans}"
        trajs, records = _play(run, tokenizer, WINDOW, log_windows=True, spans=spans)
        traj = trajs[0]
        page = (build_site(run, tmp_path / f"out_{spans}").parent / "step_000001" / "traj_0000.html").read_text()
        rows = re.findall(r"<details><summary>Turn (\d+): ([^<]*)</summary><div class='tokens'>(.*?)</div></details>",
                          page, re.DOTALL)
        assert [int(k) for k, _, _ in rows] == [1, 2, 3]
        for k, (_, summary, body) in enumerate(rows):
            start, end = traj.turn_spans[k]
            expected = "".join(tokenizer.decode([i]) for i in traj.window_prompts[k] + traj.input_ids[start:end])
            assert _text(body) == expected, k
            assert f"window prompt ({len(traj.window_prompts[k])} tokens) + the {end - start} tokens" in summary
            # the turn's own tokens keep their colour and advantage; the window is grey (context, not trained)
            assert body.count("advantage +0.5000") == end - start
        # turn 3's window holds turn 2 only (max_context_window=1): turn 1's answer is not in it, but it is in the
        # whole-episode sequence the page shows below
        assert "first" not in _text(rows[2][2]) and "second" in _text(rows[2][2]) and "third" in _text(rows[2][2])
        assert "first" in _text(page[page.index("<h3>Whole episode"):])
        assert "does not record" not in page


def test_window_prompt_text_is_escaped(tmp_path, tokenizer):
    run = tmp_path / "run"
    _, records = _play(run, tokenizer, WINDOW, log_windows=True)
    records[0]["window_prompts"][1].insert(3, EVIL)
    records[0]["window_prompts"][2] = EVIL + " as one string"
    (run / "rollouts" / "step_000001.jsonl").write_text(json.dumps(records[0]) + "\n")
    page = (build_site(run, tmp_path / "out").parent / "step_000001" / "traj_0000.html").read_text()
    lowered = FRAME_RE.sub("", page).lower()  # the viewer's own rendered Sokoban frames are the only images
    assert "<script" not in lowered and "<img" not in lowered and "onerror=\"" not in lowered
    assert "\u202e" not in page and "&lt;U+202E&gt;</span>" in page
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 2


def test_a_full_mode_page_is_unchanged(tmp_path, tokenizer):
    run = tmp_path / "run"
    _play(run, tokenizer, [])
    page = (build_site(run, tmp_path / "out").parent / "step_000001" / "traj_0000.html").read_text()
    assert "context_mode" not in page and "Whole episode" not in page and "<details><summary>Turn" not in page
    assert "<h2>Tokens</h2><div class='legend'>" in page


# ----------------------------------------------------------------------------- index metrics


def _metrics_run(root: Path) -> Path:
    """Steps 1-2 with metrics only, step 3 also with a trajectory; many metrics, alphabetically early junk first."""
    run = root / "run"
    (run / "rollouts").mkdir(parents=True)
    rows = []
    for step in (1, 2, 3):
        row = {"step": step}
        row.update({f"aaa/junk_{i:02d}": float(i) for i in range(12)})  # would win an alphabetical cut
        row.update({f"actor/{n}": 0.1 * step for n in ("approx_kl", "backward_skipped", "clipfrac_low", "lr")})
        row.update({"train/sokoban/success": 0.5, "train/sokoban/reward_mean": 0.25})  # per tag
        row.update({"val/success": 0.25 * step, "val/reward_mean": -1.0 + step, "train/success": 0.5,
                    "train/reward_mean": 0.3, "train/format_valid": 0.9, "actor/entropy": 1.5,
                    "actor/grad_norm": 2.5, "actor/kl_loss": 0.001 * step, "time/step_s": 9.0,
                    EVIL: 7.0, "note": "a string metric"})
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    traj = {"env": "bandit", "turns": [{"response": "<answer>a</answer>"}], "tokens": ["a"], "loss_mask": [1],
            "advantages": [1.0]}
    (run / "rollouts" / "step_000003.jsonl").write_text(json.dumps(traj) + "\n")
    return run


def _columns(index_text: str) -> list[str]:
    head = re.search(r"<table class='data'><tr>(.*?)</tr>", index_text).group(1)
    return [_text(c.replace("&lt;U+202E&gt;", "\u202e")) for c in re.findall(r"<th[^>]*>(.*?)</th>", head)]


def test_the_index_shows_the_important_metrics_first(tmp_path):
    index = build_site(_metrics_run(tmp_path), tmp_path / "out").read_text()
    columns = _columns(index)
    preferred = ["val/success", "val/reward_mean", "train/success", "train/reward_mean", "train/format_valid",
                 "actor/entropy", "actor/grad_norm", "actor/kl_loss", "actor/approx_kl", "time/step_s"]
    assert [c for c in columns if c in INDEX_METRICS] == preferred  # all of them, in this order
    assert columns[:3] == ["step", "trajectories", "all metrics"] and columns[3:3 + len(preferred)] == preferred
    extra = columns[3 + len(preferred):]
    assert len(extra) == MAX_EXTRA_METRICS
    # run-wide metrics before per-tag ones, then by name
    assert extra == sorted(extra, key=lambda k: (k.count("/"), k))
    assert "train/sokoban/success" not in columns


def test_every_logged_metric_is_reachable_and_the_index_says_how_many_more(tmp_path):
    run = _metrics_run(tmp_path)
    out = tmp_path / "out"
    index = build_site(run, out).read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {k for r in rows for k in r if k != "step"}
    shown = set(_columns(index)[3:])
    more = logged - shown
    assert len(more) == len(logged) - len(shown) > 0
    assert f"The table shows {len(shown)} of the {len(logged)} logged metrics" in index
    assert f"<b>{len(more)} more metrics</b>" in index
    # every step's row has every metric, with its value, steps without saved trajectories included
    for row in rows:
        cell = re.search(rf"<tr><td>{row['step']}</td><td class='l'>.*?</td><td class='l'>(.*?)</td>", index).group(1)
        text = _text(cell.replace("&lt;U+202E&gt;", "\u202e"))
        assert text.startswith(f"{len(logged)}")
        for key in logged:
            assert key in text, (row["step"], key)
        assert "val/reward_mean " + f"{row['val/reward_mean']:.4g}" in text
    # the step page with trajectories has them all too
    step = (out / "step_000003.html").read_text()
    assert f"<h2>Metrics ({len(logged)})</h2>" in step
    assert all(k in _text(step.replace("&lt;U+202E&gt;", "\u202e")) for k in logged)
    # metric names are untrusted text
    for page in (index, step):
        assert "<script" not in page.lower() and "<img" not in page.lower() and "\u202e" not in page
