"""``ragen view``: bidi controls in model text are shown, not obeyed; a rebuild drops pages of steps that are gone."""

import json
import os
import re

from ragen.viz.page import e
from ragen.viz.viewer import build_site

# Every Unicode bidirectional control ("Trojan Source", CVE-2021-42574): ALM, LRM, RLM, LRE..RLO, LRI..PDI.
BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
# Ordinary non-ASCII text, Arabic and Hebrew letters included: it must come through unchanged.
PLAIN = "café naïve 日本語 中文 한국어 العربية עברית Ωμέγα"


def _marker(char):
    return f"<span class='bidi' title='bidi control'>&lt;U+{ord(char):04X}&gt;</span>"


def _run(root, steps, name="run"):
    """A run dir with ``steps`` = {step: [trajectory, ...]} as rollout files and one metrics line per step."""
    run = root / name
    (run / "rollouts").mkdir(parents=True, exist_ok=True)
    for old in (run / "rollouts").iterdir():
        old.unlink()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/success": 0.5}) + "\n" for s in steps))
    for step, trajs in steps.items():
        text = "".join(json.dumps(t) + "\n" for t in trajs)
        (run / "rollouts" / f"step_{step:06d}.jsonl").write_text(text)
    return run


def _traj(i=0):
    return {"env": "bandit", "turns": [{"response": f"<answer>{i}</answer>"}], "tokens": ["a"], "loss_mask": [1],
            "advantages": [1.0]}


def _evil_traj():
    rlo = "\u202e"
    return {
        "env": "bandit" + rlo + "x",
        "tag": "tag" + BIDI,
        "error": "env failed " + BIDI,
        "initial_observation": "prompt obs " + BIDI + " " + PLAIN,
        "turns": [
            {"response": "<think>t" + BIDI + "</think><answer>" + rlo + "tfel</answer>", "actions": ["a" + rlo],
             "observation": "after " + BIDI},
            {"response": "no tags " + BIDI + " " + PLAIN},
        ],
        # prompt tokens (masked) and model tokens
        "tokens": ["<|im_start|>user\n" + BIDI, PLAIN, "x" + rlo + "y"],
        "loss_mask": [0, 1, 1],
        "advantages": [0.0, 1.0, -1.0],
    }


def test_bidi_controls_in_model_and_env_text_are_shown_not_obeyed(tmp_path):
    run = _run(tmp_path, {1: [_evil_traj()]})
    out = tmp_path / "out"
    build_site(run, out)
    pages = sorted(out.rglob("*.html"))
    assert len(pages) == 3
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert not [c for c in BIDI if c in text], page.name  # not one control left to act
    traj = (out / "step_000001" / "traj_0000.html").read_text(encoding="utf-8")
    for char in BIDI:
        assert _marker(char) in traj
    # each place model or env text is shown: answer, raw response, actions, observations, tokens, error, env name
    assert f"<pre class='answer'>{_marker(chr(0x202E))}tfel</pre>" in traj
    assert f"<code>a{_marker(chr(0x202E))}</code>" in traj
    assert f"<b>env</b> bandit{_marker(chr(0x202E))}x" in traj
    assert f"<span class='bad'>env failed {_marker(chr(0x061C))}" in traj
    assert f"<pre class='obs'>prompt obs {_marker(chr(0x061C))}" in traj
    assert f"<pre class='obs'>after {_marker(chr(0x061C))}" in traj
    assert re.search(r"<span class='m' title='#0 [^']*'>&lt;\|im_start\|&gt;user\n" + re.escape(_marker("\u061c")), traj)
    assert re.search(r"<span class='n\d' title='#2 [^']*'>x" + re.escape(_marker("\u202e")) + "y</span>", traj)
    step = (out / "step_000001.html").read_text(encoding="utf-8")
    assert f"<td class='l'>env failed {_marker(chr(0x061C))}" in step
    assert "span.bidi{" in traj  # styled, so a real control stands apart from a model writing "<U+202E>"


def test_ordinary_non_ascii_text_is_left_as_it_is(tmp_path):
    run = _run(tmp_path, {1: [_evil_traj()]})
    build_site(run, tmp_path / "out")
    traj = (tmp_path / "out" / "step_000001" / "traj_0000.html").read_text(encoding="utf-8")
    assert traj.count(PLAIN) >= 3  # observation, raw response, token
    assert e(PLAIN) == PLAIN


def test_bidi_marker_stays_plain_text_in_attributes_and_the_title(tmp_path):
    # a run dir whose name holds a control: it is in <title>, where markup would show as text, not render
    run = _run(tmp_path, {1: [_traj()]}, name="run\u202eevil")
    build_site(run, tmp_path / "out")
    text = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    title = re.search(r"<title>(.*?)</title>", text).group(1)
    assert title == "ragen run run&lt;U+202E&gt;evil"
    assert "<h1>Run run" + _marker("\u202e") + "evil</h1>" in text
    assert e("a\u2066'b") == "a&lt;U+2066&gt;&#x27;b"  # attribute-safe: no markup, no quote


def _names(out):
    return sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def test_a_rebuild_removes_pages_of_steps_the_run_no_longer_has(tmp_path):
    out = tmp_path / "out"
    build_site(_run(tmp_path, {1: [_traj(0)], 2: [_traj(0), _traj(1)], 3: [_traj(0)]}), out)
    assert (out / "step_000002" / "traj_0001.html").is_file()
    # rollout files pruned / the run restarted: step 2 is gone, step 3 now has one trajectory fewer... and step 1 none
    build_site(_run(tmp_path, {1: [], 3: [_traj(0)]}), out)
    assert _names(out) == ["index.html", "step_000001", "step_000001.html", "step_000003", "step_000003.html",
                           "step_000003/traj_0000.html"]
    index = (out / "index.html").read_text(encoding="utf-8")
    assert "step_000002" not in index


def test_a_step_with_fewer_trajectories_loses_the_pages_past_its_last(tmp_path):
    out = tmp_path / "out"
    build_site(_run(tmp_path, {1: [_traj(0), _traj(1), _traj(2)]}), out)
    build_site(_run(tmp_path, {1: [_traj(0)]}), out)
    assert _names(out) == ["index.html", "step_000001", "step_000001.html", "step_000001/traj_0000.html"]


def test_a_rebuild_removes_only_what_the_viewer_wrote(tmp_path):
    out = tmp_path / "out"
    build_site(_run(tmp_path, {1: [_traj()], 2: [_traj()]}), out)
    ours = (out / "step_000002.html").read_text(encoding="utf-8")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "dir").mkdir(parents=True)
    (elsewhere / "page.html").write_text(ours)
    (elsewhere / "dir" / "traj_0000.html").write_text(ours)
    keep = {
        "notes.txt": "mine",
        "step_2.html": ours,  # not a name the viewer writes (it pads to 6 digits) ...
        "step_0000002.html": ours,  # ... nor this
        "step_000002.htm": ours,
        "step_000002.html.bak": ours,
        "step_000009.html": "<html>a page of my own</html>",  # our name, not our page
        "traj_0000.html": ours,  # trajectory pages live in step folders only
        "step_000002/notes.txt": "mine",  # the stale step folder holds a file of the user's
        "step_000002/traj_1.html": ours,
    }
    for name, text in keep.items():
        (out / name).write_text(text, encoding="utf-8")
    os.symlink(elsewhere / "page.html", out / "step_000007.html")
    os.symlink(elsewhere / "dir", out / "step_000008")
    build_site(_run(tmp_path, {1: [_traj()]}), out)
    for name, text in keep.items():
        assert (out / name).read_text(encoding="utf-8") == text, name
    assert not (out / "step_000002.html").exists() and not (out / "step_000002" / "traj_0000.html").exists()
    assert (out / "step_000007.html").is_symlink() and (out / "step_000008").is_symlink()
    assert (elsewhere / "page.html").is_file() and (elsewhere / "dir" / "traj_0000.html").is_file()
    assert (out / "step_000001" / "traj_0000.html").is_file()
