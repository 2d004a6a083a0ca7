"""``ragen view``: the static site renders runs, and untrusted model text stays text (also in a real browser)."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ragen.cli import main
from ragen.viz.viewer import build_site, parse_grid, split_response

CHROMIUM = "/usr/bin/chromium"

PAYLOADS = [
    "<script>alert(1)</script>",
    "<img src=x onerror=\"document.title='PWNED'\">",
    "\"><svg onload=\"document.title='PWNED'\">",
    "'><a href='javascript:alert(1)'>click</a>",
    "<iframe src=javascript:alert(1)></iframe>",
]
EVIL = " ".join(PAYLOADS)
GRID0 = "######\n#_P__#\n#_X__#\n#_O__#\n######"
GRID1 = "######\n#____#\n#_P__#\n#_√__#\n######"


def _traj(step, i, response, env="sokoban", obs0=GRID0, obs1=GRID1):
    tokens = ["<|im_start|>", "user", "\n", EVIL, "<|im_end|>", "<think>", " push", " down", "</think>",
              "<answer>", "Down", "</answer>", "<img src=x onerror=\"document.title='PWNED'\">"]
    mask = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    advantages = [0.0] * 5 + [0.53, 0.53, -0.2, 0.0, 1.5, 1.5, 1.5, -1.5]
    return {
        "step": step, "env": env, "group_id": i // 2, "seed": 100 + i, "reward": 1.2 if i == 0 else -0.3,
        "success": i == 0, "error": "" if i == 0 else EVIL,
        "initial_observation": obs0,
        "turns": [
            {"response": response, "actions": ["Down", EVIL], "format_valid": True, "env_reward": 1.0,
             "format_penalty": 0.0, "observation": obs1},
            {"response": "no tags at all " + EVIL, "actions": [], "format_valid": False, "env_reward": -0.1,
             "format_penalty": -0.1, "observation": obs1},
        ],
        "tokens": tokens, "loss_mask": mask, "advantages": advantages,
    }


RESPONSE = "<think>I will push the box down onto the target. " + EVIL + "</think><answer>Down</answer>"


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run_evil"
    (run / "rollouts").mkdir(parents=True)
    (run / "config.yaml").write_text("env:\n  name: sokoban  # " + EVIL + "\n")
    rows = [
        {"step": 1, "train/success": 0.25, "train/reward_mean": -0.5, "actor/entropy": 1.2, "actor/grad_norm": 3.0,
         "train/response_length": 40.0, "time/step_s": 12.5},
        {"step": 2, "train/success": 0.5, "train/reward_mean": 0.1, "actor/entropy": 1.1, "actor/grad_norm": 2.0,
         "train/response_length": 35.0, "time/step_s": 11.0},
        {"step": 2, "val/success": 0.4},
        {"step": 3, "train/success": 0.75, "train/reward_mean": 0.6, "actor/entropy": 1.0, "actor/grad_norm": 1.5,
         "train/response_length": 30.0, "time/step_s": 10.0, EVIL: 1.0},
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    trajs = [_traj(3, 0, RESPONSE), _traj(3, 1, RESPONSE),
             _traj(3, 2, "<answer>Left", env="frozen_lake", obs0="P__\n_O_\n__G", obs1="___\nX__\n__G"),
             _traj(3, 3, RESPONSE, env=EVIL, obs0=EVIL, obs1=EVIL)]
    (run / "rollouts" / "step_000003.jsonl").write_text("\n".join(json.dumps(t) for t in trajs) + "\n")
    return run


def _pages(out: Path):
    return sorted(out.rglob("*.html"))


def test_site_structure_and_content(run_dir, tmp_path):
    index = build_site(run_dir, tmp_path / "site")
    assert index == tmp_path / "site" / "index.html"
    text = index.read_text()
    for snippet in ("train/success", "val/success", "0.75", "step_000003.html", "4 trajectories", "config.yaml"):
        assert snippet in text
    step = (tmp_path / "site" / "step_000003.html").read_text()
    assert "step_000003/traj_0003.html" in step and "frozen_lake" in step
    traj = (tmp_path / "site" / "step_000003" / "traj_0000.html").read_text()
    assert "I will push the box down onto the target." in traj
    assert "<pre class='answer'>Down</pre>" in traj
    assert "class='sk-wall'" in traj and "class='sk-boxok'" in traj and "player on target" in traj
    assert re.search(r"<span class='p8' title='#9 advantage \+1\.5000'>", traj)
    assert re.search(r"<span class='n8' title='#12 advantage -1\.5000'>", traj)
    assert "<span class='m' title='#0 not trained" in traj
    assert "<span class='z' title='#8 advantage +0.0000'>" in traj
    lake = (tmp_path / "site" / "step_000003" / "traj_0002.html").read_text()
    assert "class='fl-hole'" in lake and "class='fl-dead'" in lake and "<pre class='answer'>Left</pre>" in lake
    # unknown env: observation as text, not as a grid
    other = (tmp_path / "site" / "step_000003" / "traj_0003.html").read_text()
    assert "<table class='grid'>" not in other


def test_untrusted_text_is_escaped_everywhere(run_dir, tmp_path):
    build_site(run_dir, tmp_path / "site")
    pages = _pages(tmp_path / "site")
    assert len(pages) == 1 + 1 + 4
    for page in pages:
        text = page.read_text()
        lowered = text.lower()
        for raw in ("<script", "<img", "<svg", "<iframe", "<a href='javascript", "onerror=\"", "onload=\""):
            assert raw not in lowered, (page.name, raw)
        assert "<a href='javascript" not in lowered and 'href="javascript' not in lowered
        # only links we generate
        for href in re.findall(r"href='([^']*)'", text):
            assert re.fullmatch(r"(\.\./)?(index|step_\d{6}(/traj_\d{4})?)\.html|traj_\d{4}\.html", href), href
    traj = (tmp_path / "site" / "step_000003" / "traj_0000.html").read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in traj
    assert "&lt;img src=x onerror=&quot;document.title=&#x27;PWNED&#x27;&quot;&gt;" in traj
    assert "&quot;&gt;&lt;svg onload=" in traj
    assert "Content-Security-Policy" in traj and "default-src 'none'" in traj


def test_split_response_and_grid_parsing():
    assert split_response("<think>a</think><answer>b</answer>") == ("a", "b")
    assert split_response("<THINK> a <answer> b") == ("a", "b")
    assert split_response("<answer>Up</ answer > junk") == (None, "Up")
    assert split_response("plain") == (None, None)
    assert split_response(None) == (None, None)
    assert parse_grid("walls: (0, 0)\n###\n#P#\n###\nplayer: (1, 1)", "#_OX√PS") == ["###", "#P#", "###"]
    assert parse_grid("#P", "#P") is None
    assert parse_grid("Sorry", "#_OX√PS") is None


def test_missing_run_dir_and_empty_run(tmp_path, capsys):
    with pytest.raises(FileNotFoundError):
        build_site(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    index = build_site(empty)
    assert "No steps logged yet" in index.read_text()
    assert main(["view", str(tmp_path / "nope")]) == 2
    assert "run directory not found" in capsys.readouterr().err


def test_cli_view(run_dir, tmp_path, capsys):
    assert main(["view", str(run_dir), "--out", str(tmp_path / "o")]) == 0
    assert str(tmp_path / "o" / "index.html") in capsys.readouterr().out
    assert (tmp_path / "o" / "step_000003" / "traj_0001.html").is_file()


def _chromium(url: str, profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("page", ["step_000003/traj_0000.html", "step_000003/traj_0003.html", "step_000003.html",
                                  "index.html"])
def test_pages_in_headless_chromium(run_dir, tmp_path, page):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium) - browser check skipped")
    build_site(run_dir, tmp_path / "site")
    url = (tmp_path / "site" / page).resolve().as_uri()
    done = _chromium(url, tmp_path / "profile")
    dom = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert "<body" in dom, done.stderr[-2000:]
    assert "PWNED" not in (re.search(r"<title>(.*?)</title>", dom, re.S) or [None, ""])[1]
    lowered = dom.lower()
    for element in ("<img", "<svg", "<script", "<iframe", "href=\"javascript"):
        assert element not in lowered, element
    if page.endswith("traj_0000.html"):
        assert "I will push the box down onto the target." in dom
        assert "&lt;img src=x onerror=" in dom  # the payload is there, as text
        assert "class=\"sk-player\"" in dom
    errors = [line for line in done.stderr.splitlines() if "Uncaught" in line or "CONSOLE" in line]
    assert not errors, errors
