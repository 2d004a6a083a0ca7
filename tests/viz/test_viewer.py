"""``ragen view``: the static site renders runs, and untrusted model text stays text (also in a real browser)."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ragen.cli import main
from ragen.config import RUN_CONFIG_HEADER
from ragen.viz.episode_html import parse_grid, split_response
from ragen.viz.viewer import build_site

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
    started = tmp_path / "started"  # a run that has written only its config.yaml so far
    started.mkdir()
    (started / "config.yaml").write_text(RUN_CONFIG_HEADER + "model: tiny\n")
    index = build_site(started)
    assert "No steps logged yet" in index.read_text()
    assert main(["view", str(tmp_path / "nope")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    empty = tmp_path / "empty"  # not a run: refused, and nothing is written into it
    empty.mkdir()
    assert main(["view", str(empty)]) == 2
    assert "holds no run to view" in capsys.readouterr().err and not any(empty.iterdir())


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


# ------------------------------------------------------------------ rendered env frames (replayed)

IMG_RE = re.compile(r"<img class='render' src='data:image/png;base64,([A-Za-z0-9+/=]+)' alt='[^'<>]*'>")
REPLIES = [
    "<think>go</think><answer>Up || Left</answer>",
    "<think>go</think><answer>Down || Right</answer>",
    "<answer>Jump</answer>",  # no <think>: invalid, nothing is stepped
    "<think>go</think><answer>Right || Down</answer>",
    "<think>go</think><answer>Left || Sideways</answer>",  # unknown action: invalid
    "<think>go</think><answer>Down</answer>",
]


class ScriptedBackend:
    """Replies from ``replies`` (default ``REPLIES``) in turn, per prompt; stands in for the model in a real ``Rollout``."""

    def __init__(self, tokenizer, replies=REPLIES):
        self.tokenizer, self.replies, self.calls = tokenizer, replies, 0

    def generate(self, prompts, params):
        from ragen.models.backend import Generation

        out = []
        for _ in prompts:
            reply = self.replies[self.calls % len(self.replies)]
            self.calls += 1
            out.append(Generation(self.tokenizer(reply, add_special_tokens=False)["input_ids"], "stop"))
        return out


def _write_run(run: Path, tokenizer, preset, overrides=(), seeds_per_group=(3, 8), step=1) -> list[dict]:
    """A run dir as the trainer writes it: config.yaml and one rollouts file, from a real Rollout."""
    from dataclasses import asdict

    from ragen.agent import AgentConfig, Rollout
    from ragen.config import load_config, to_yaml
    from ragen.models.backend import SamplingParams
    from ragen.agent.env_sets import Slots, train_sets

    config = load_config(preset, list(overrides))
    slots = Slots.build(train_sets(config), config.rollout.group_size)
    size = config.rollout.group_size
    n_groups = len(slots) // size
    seeds = [seeds_per_group[g % len(seeds_per_group)] + g for g in range(n_groups) for _ in range(size)]
    groups = [g for g in range(n_groups) for _ in range(size)]
    rollout = Rollout(ScriptedBackend(tokenizer), tokenizer, AgentConfig(**asdict(config.agent)), SamplingParams())
    trajs = rollout.run(slots.envs, seeds, groups, slots.env_names, settings=slots.settings, tags=slots.tags)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(to_yaml(config))
    records = [
        {"step": step, **t.to_json(), "tokens": [tokenizer.decode([i]) for i in t.input_ids],
         "loss_mask": t.loss_mask, "advantages": [0.0] * len(t.input_ids)}
        for t in trajs
    ]
    (run / "rollouts").mkdir(exist_ok=True)
    (run / "rollouts" / f"step_{step:06d}.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return records


def _pngs(page_text: str):
    """The decoded <img> frames of a page, in order (PIL)."""
    import base64
    import io

    import numpy as np

    Image = pytest.importorskip("PIL.Image")
    out = []
    for data in IMG_RE.findall(page_text):
        with Image.open(io.BytesIO(base64.b64decode(data))) as img:
            out.append(np.asarray(img.convert("RGB")))
    return out


def _expected_frames(record, env_cfg, max_actions=None):
    """The frames replayed directly on the env, for comparison (initial + after each turn)."""
    import ragen.envs

    env = ragen.envs.make(record["env"], render_mode="rgb_array", **env_cfg)
    env.reset(seed=record["seed"])
    frames, left = [env.render()], max_actions
    for turn in record["turns"]:
        if turn["format_valid"]:
            for action in turn["actions"][: left if left is not None else None]:
                _, _, terminated, truncated, _ = env.step(env.unwrapped.parse_action(action))
                left = None if left is None else left - 1
                if terminated or truncated:
                    break
        frames.append(env.render())
    return frames


@pytest.fixture
def sokoban_run(tmp_path, tokenizer):
    run = tmp_path / "sokoban_run"
    records = _write_run(run, tokenizer, "sokoban", ["rollout.env_groups=2", "rollout.group_size=2"])
    return run, records


def test_sokoban_pages_show_one_verified_frame_per_turn(sokoban_run, tmp_path):
    import numpy as np

    run, records = sokoban_run
    assert len(records) == 4 and all(r["env"] == "sokoban" and r["tag"] == "sokoban" for r in records)
    assert any(not t["format_valid"] for t in records[0]["turns"])  # invalid turns are part of the test
    build_site(run, tmp_path / "site")
    for i, record in enumerate(records):
        page = (tmp_path / "site" / "step_000001" / f"traj_{i:04d}.html").read_text()
        frames = _pngs(page)
        # The initial observation, then one frame after every turn.
        assert len(frames) == len(record["turns"]) + 1 >= 2
        assert page.count("<img") == len(frames)
        assert "No rendered frame" not in page
        expected = _expected_frames(record, {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 100}, max_actions=10)
        assert all(np.array_equal(a, b) for a, b in zip(frames, expected))
        assert frames[0].shape == (6 * 32, 6 * 32, 3)
        moved = [t for t in record["turns"] if t["format_valid"]]
        if moved and any(t["observation"] != record["initial_observation"] for t in moved):
            assert any(not np.array_equal(frames[0], f) for f in frames[1:])


def test_mixed_tags_and_slippery_lake_replay(tmp_path, tokenizer):
    tags = ("es.train=[{tag: SimpleSokoban, groups: 1}, {tag: SlipperyFrozenLake, groups: 1}, "
            "{tag: BigLake, groups: 1}, {tag: Bandit, groups: 1}]")
    records = _write_run(
        tmp_path / "mixed", tokenizer, None,
        # SlipperyFrozenLake without env extends the preset: still slippery, now 5x5 (replayed as the trainer resolved it)
        [tags, "es.tags={BigLake: {env: frozen_lake, config: {size: 5, is_slippery: true}, max_turn: 4}, "
               "SlipperyFrozenLake: {config: {size: 5}}}",
         "rollout.group_size=2", "agent.max_turn=5", "agent.max_actions_per_turn=2"],
        seeds_per_group=(30,),
    )
    assert [r["tag"] for r in records] == ["SimpleSokoban"] * 2 + ["SlipperyFrozenLake"] * 2 + ["BigLake"] * 2 + ["Bandit"] * 2
    build_site(tmp_path / "mixed", tmp_path / "site")
    for i, record in enumerate(records):
        page = (tmp_path / "site" / "step_000001" / f"traj_{i:04d}.html").read_text()
        if record["env"] == "bandit":
            assert "<img" not in page and "No rendered frame" not in page
            continue
        frames = _pngs(page)
        assert len(frames) == len(record["turns"]) + 1 and "No rendered frame" not in page, record["tag"]
        size = 6 if record["env"] == "sokoban" else 5
        assert frames[0].shape == (size * 32, size * 32, 3)


def test_replay_that_does_not_match_shows_a_note_not_a_frame(sokoban_run, tmp_path):
    run, records = sokoban_run
    record = next(r for r in records if sum(t["format_valid"] for t in r["turns"]) >= 2)
    k = next(i for i, t in enumerate(record["turns"]) if t["format_valid"] and i > 0)
    tampered = json.loads(json.dumps(record))
    tampered["turns"][k]["observation"] = tampered["turns"][k]["observation"].replace("P", "_", 1).replace("_", "P", 1)
    assert tampered["turns"][k]["observation"] != record["turns"][k]["observation"]
    wrong_seed = dict(json.loads(json.dumps(record)), seed=record["seed"] + 1)
    no_config = json.loads(json.dumps(record))
    bad_member = dict(json.loads(json.dumps(record)), group_member="1")
    path = run / "rollouts" / "step_000002.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (tampered, wrong_seed, no_config, bad_member)) + "\n")
    build_site(run, tmp_path / "site")
    page = (tmp_path / "site" / "step_000002" / "traj_0000.html").read_text()
    assert len(_pngs(page)) == k + 1  # initial + turns before the tampered one
    assert f"No rendered frame: turn {k + 1}: the replayed observation differs from the recorded one" in page
    page = (tmp_path / "site" / "step_000002" / "traj_0001.html").read_text()
    assert "<img" not in page and "gave a different initial observation" in page
    page = (tmp_path / "site" / "step_000002" / "traj_0003.html").read_text()
    assert "<img" not in page and "group_member &#x27;1&#x27; is not a non-negative int" in page
    # Without config.yaml the env's default config is tried, and still verified (SimpleSokoban = the defaults).
    (run / "config.yaml").unlink()
    build_site(run, tmp_path / "site2")
    page = (tmp_path / "site2" / "step_000002" / "traj_0002.html").read_text()
    assert len(_pngs(page)) == len(record["turns"]) + 1


def test_sokoban_frames_in_headless_chromium(sokoban_run, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium) - browser check skipped")
    run, records = sokoban_run
    build_site(run, tmp_path / "site")
    page = tmp_path / "site" / "step_000001" / "traj_0000.html"
    shot = tmp_path / "shot.png"
    done = _chromium(page.resolve().as_uri(), tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert dom.count('<img class="render" src="data:image/png;base64,') == len(records[0]["turns"]) + 1
    # A blocked or broken image would be logged on the console (CSP violations are).
    errors = [line for line in done.stderr.splitlines() if "Uncaught" in line or "CONSOLE" in line]
    assert not errors, errors
    # The browser really decodes and paints the PNGs: the wall mortar colour exists only in the images.
    shot_run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         f"--user-data-dir={tmp_path / 'profile2'}", "--window-size=1200,900", "--hide-scrollbars",
         f"--screenshot={shot}", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert shot_run.returncode == 0 and shot.is_file(), shot_run.stderr[-2000:]
    Image = pytest.importorskip("PIL.Image")
    import numpy as np

    with Image.open(shot) as img:
        pixels = np.asarray(img.convert("RGB")).reshape(-1, 3)
    assert (pixels == (112, 112, 112)).all(axis=1).sum() > 50


def test_episodes_left_out_of_the_update_are_not_shown_as_trained():
    from ragen.viz.episode_html import _adv_scale, render_tokens

    traj = {"tokens": ["a", "b"], "loss_mask": [0, 1], "advantages": [0.0, 0.0], "in_update": False}
    html = render_tokens(traj, 1.0)
    assert "left out of the update" in html and "advantage" not in html
    assert _adv_scale([{**traj, "advantages": [0.0, 9.0]}]) == 0.0  # its zeros set no colour scale
    assert "advantage +0.5000" in render_tokens({**traj, "advantages": [0.0, 0.5], "in_update": True}, 1.0)


def test_the_step_table_shows_tags_and_env_errors_as_such():
    from ragen.viz.viewer import _step_page

    trajs = [{"env": "bandit", "tag": "BanditTest", "success": False, "reward": 0.0, "error": "Env.step raised X", "turns": []},
             {"env": "bandit", "tag": "bandit", "success": True, "reward": 1.0, "turns": [{}]}]
    page = _step_page("run", 3, {}, trajs, None, None)
    assert "bandit (BanditTest)" in page and "env error" in page
    assert "<tr class=''>" in page and "<tr class='ok'>" in page  # the errored row is neither a success nor a failure
