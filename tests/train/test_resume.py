"""Checkpoints: a run killed with SIGKILL and resumed writes the same metrics as an uninterrupted run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ragen.cli import main
from ragen.train.checkpoint import latest_checkpoint

ARGS = ["model=tiny", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
        "trainer.val_episodes=2", "trainer.progress_bar=false", "trainer.save_freq=1", "trainer.val_freq=2",
        "optim.lr=1e-3", "trainer.num_threads=1",
        "trainer.plot=false"]  # (curves.png costs ~1.2 s a run; tests/viz draws it)


def _ragen(*argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "ragen", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith("time/")} for line in lines]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_sigkill_and_resume_gives_identical_metrics(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert main(["train", "bandit", "trainer.total_steps=4", f"trainer.output_dir={full}", *ARGS]) == 0

    proc = _ragen("train", "bandit", "trainer.total_steps=4", f"trainer.output_dir={killed}", *ARGS)
    _wait_for(killed / "checkpoints" / "step_000002" / "COMPLETE", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert main(["train", "--resume", str(killed)]) == 0

    assert [m["step"] for m in _metrics(killed)] == [0, 1, 2, 3, 4]
    assert _metrics(killed) == _metrics(full)
    # summary.json describes the whole run: validation before step 1 comes from the first session's log
    resumed, whole = (json.loads((run / "summary.json").read_text()) for run in (killed, full))
    assert resumed["val_before"] == whole["val_before"] and resumed["val_after"] == whole["val_after"]
    assert resumed["resumed_from_step"] >= 2 and "resumed_from_step" not in whole


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=2", f"trainer.output_dir={run}", *ARGS]) == 0
    newest = run / "checkpoints" / "step_000002"
    (newest / "model.safetensors").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        path, ckpt = latest_checkpoint(run)
    assert path.name == "step_000001" and ckpt["state"]["step"] == 1
    # A half-written checkpoint (no COMPLETE marker) is ignored the same way.
    shutil.rmtree(newest)
    partial = run / "checkpoints" / "step_000003"
    partial.mkdir()
    with pytest.warns(UserWarning, match="incomplete"):
        assert latest_checkpoint(run)[0].name == "step_000001"
    # A checkpoint whose state.json lacks what a resume reads is skipped too (was a KeyError at restore).
    shutil.rmtree(partial)
    shutil.copytree(run / "checkpoints" / "step_000001", partial)
    (partial / "state.json").write_text("{}")
    with pytest.warns(UserWarning, match="lacks 'step'"):
        assert latest_checkpoint(run)[0].name == "step_000001"


def test_a_run_killed_mid_line_of_metrics_resumes_and_a_damaged_log_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=2", f"trainer.output_dir={run}", *ARGS]) == 0
    shutil.rmtree(run / "checkpoints" / "step_000002")  # killed during step 2's log line, before its checkpoint
    metrics = run / "metrics.jsonl"
    whole = metrics.read_text()
    lines = whole.splitlines()
    metrics.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # no newline: cut short
    assert main(["train", "--resume", str(run)]) == 0
    assert [m["step"] for m in _metrics(run)] == [0, 1, 2]
    # A line that does not parse before the last one is damage, not a cut-short write: refused, the log kept as is.
    damaged = "\n".join([lines[0], "{not json", *lines[1:]]) + "\n"
    metrics.write_text(damaged)
    assert main(["train", "--resume", str(run), "trainer.total_steps=3"]) == 2
    assert f"{metrics}:2: not a metrics record" in capsys.readouterr().err
    assert metrics.read_text() == damaged


def test_a_failed_resume_leaves_config_yaml_and_a_finished_run_keeps_its_summary(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=1", f"trainer.output_dir={run}", *ARGS]) == 0
    config, summary = (run / "config.yaml").read_text(), json.loads((run / "summary.json").read_text())
    # Resuming the finished run: nothing to run, and the summary still has the run's last validation.
    assert main(["train", "--resume", str(run)]) == 0
    assert "no step left to run" in capsys.readouterr().out
    again = json.loads((run / "summary.json").read_text())
    assert again["val_after"] == summary["val_after"] and again["val_before"] == summary["val_before"]
    # A resume that fails (no checkpoint) does not rewrite config.yaml with its overrides.
    shutil.rmtree(run / "checkpoints")
    assert main(["train", "--resume", str(run), "--force", "seed=7", "trainer.total_steps=3"]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == config


def test_a_resume_with_no_checkpoint_stops_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import ragen.train.trainer as trainer_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded for a resume with nothing to restore")

    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=1", f"trainer.output_dir={run}",
                 *ARGS]) == 0
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    capsys.readouterr()
    monkeypatch.setattr(trainer_module, "load_model", no_loading)  # the embedded model's first load takes ~17 s
    assert main(["train", "--resume", str(run)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"ragen: error: no valid checkpoint under {run / 'checkpoints'} "
                                                    "to resume from"]


def test_a_new_run_never_overwrites_files_it_would_write(tmp_path, capsys):
    out = tmp_path / "project"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.yaml").write_text("mine")
    assert main(["train", "bandit", "trainer.total_steps=1", f"trainer.output_dir={out}", *ARGS]) == 2
    assert "already has 'config.yaml', which the run would overwrite" in capsys.readouterr().err
    assert (out / "config.yaml").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["config.yaml", "notes.txt"]
    (out / "config.yaml").unlink()  # unrelated files are fine
    assert main(["train", "bandit", "trainer.total_steps=1", f"trainer.output_dir={out}", *ARGS]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    # A run that stopped before it logged anything left only its own config.yaml (ragen's header line): the same
    # command starts it over there instead of refusing the dir it made.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "config.yaml").write_text((out / "config.yaml").read_text())
    assert (out / "config.yaml").read_text().startswith("# ragen: this run's resolved config")
    assert main(["train", "bandit", "trainer.total_steps=1", f"trainer.output_dir={crashed}", *ARGS]) == 0
    assert (crashed / "metrics.jsonl").is_file()


def test_resume_refuses_result_changing_config_without_force(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=1", f"trainer.output_dir={run}", *ARGS]) == 0
    assert main(["train", "--resume", str(run), "optim.lr=0.5"]) == 2
    assert "changes results (optim.lr)" in capsys.readouterr().err
    # output-only keys, and a smaller micro-batch (the same gradient up to rounding: the fix after an OOM kill)
    assert main(["train", "--resume", str(run), "trainer.total_steps=2", "trainer.plot=false", "algorithm.micro_batch_size=1"]) == 0
    assert main(["train", "--resume", str(tmp_path / "nowhere")]) == 2


def test_a_run_from_before_disable_dropout_resumes_with_dropout_as_it_trained(tmp_path, capsys):
    """A config.yaml written before ``algorithm.disable_dropout`` existed was trained with the model's own dropout on:
    its resume keeps it on (and records it), and turning it off then is a result-changing override."""
    import yaml

    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=1", f"trainer.output_dir={run}", *ARGS]) == 0
    saved = run / "config.yaml"
    header, body = saved.read_text().split("\n", 1)
    old = yaml.safe_load(body)
    del old["algorithm"]["disable_dropout"]
    saved.write_text(header + "\n" + yaml.safe_dump(old))
    assert main(["train", "--resume", str(run), "algorithm.disable_dropout=true"]) == 2
    assert "changes results (algorithm.disable_dropout)" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "trainer.total_steps=2", "trainer.plot=false"]) == 0
    assert yaml.safe_load(saved.read_text().split("\n", 1)[1])["algorithm"]["disable_dropout"] is False


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    run = tmp_path / "run"
    no_periodic_saves = [a for a in ARGS if not a.startswith("trainer.save_freq")] + ["trainer.save_freq=0"]
    proc = _ragen("train", "bandit", "trainer.total_steps=50", f"trainer.output_dir={run}", *no_periodic_saves,
                  "trainer.val_freq=0")
    _wait_for(run / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out  # not a finished run: `ragen train ... && ragen eval ...` stops here
    assert "interrupted: checkpoint of step" in out and "Traceback" not in out
    path, ckpt = latest_checkpoint(run)
    step = ckpt["state"]["step"]
    assert 1 <= step < 50
    assert json.loads((run / "summary.json").read_text())["interrupted_at_step"] == step
    assert f"trainer.total_steps={step}" in out  # how to finish the run at this step (final/, summary)
    assert main(["train", "--resume", str(run), f"trainer.total_steps={step}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_after"]["val/episodes"] > 0 and (run / "final").is_dir()  # validated now: none was logged there


def test_a_smaller_micro_batch_changes_results_only_under_dropout():
    from ragen.config import load_config, result_changing_differences
    from ragen.sft import config as sft

    def rl(*extra):
        return load_config("bandit", ["model=tiny", *extra])

    def sft_config(*extra):
        return sft.load_sft_config(None, ["data.path=x.jsonl", *extra], check=False)

    assert result_changing_differences(rl(), rl("algorithm.micro_batch_size=1")) == []
    assert sft.result_changing_differences(sft_config(), sft_config("trainer.micro_batch_size=1")) == []
    lora = ("lora.rank=4", "lora.dropout=0.1")  # other micro-batches draw other dropout masks
    assert result_changing_differences(rl(*lora), rl(*lora, "algorithm.micro_batch_size=1")) == ["algorithm.micro_batch_size"]
    assert sft.result_changing_differences(sft_config(*lora), sft_config(*lora, "trainer.micro_batch_size=1")) == \
        ["trainer.micro_batch_size"]
    assert result_changing_differences(rl("lora.rank=4"), rl("lora.rank=4", "algorithm.micro_batch_size=1")) == []
    own = ("algorithm.disable_dropout=false",)  # the model's own dropout left on: it may have some
    assert result_changing_differences(rl(*own), rl(*own, "algorithm.micro_batch_size=1")) == ["algorithm.micro_batch_size"]
    assert result_changing_differences(rl(), rl(*own)) == ["algorithm.disable_dropout"]  # changes results itself
    # FSDP's padding passes draw dropout masks too: free to switch only without dropout
    assert result_changing_differences(rl(), rl("trainer.fsdp=true")) == []
    assert result_changing_differences(rl(*lora), rl(*lora, "trainer.fsdp=true")) == ["trainer.fsdp"]
    assert result_changing_differences(rl(*own), rl(*own, "trainer.fsdp=true")) == ["trainer.fsdp"]


def test_a_resumed_run_stops_on_collapse_at_the_step_the_uninterrupted_one_does(tmp_path, monkeypatch, capsys):
    import ragen.train.trainer as trainer_module
    from ragen.eval.collapse import CollapseMonitor

    # every step counts as collapsed-looking, so a collapse is confirmed at the third (patience 3)
    monkeypatch.setattr(trainer_module, "CollapseMonitor", lambda **kw: CollapseMonitor(entropy_floor=1e9, std_floor=1e9, **kw))
    args = [*ARGS, "trainer.stop_on_collapse=true", "trainer.val_freq=0", "trainer.total_steps=6"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main(["train", "bandit", *args, f"trainer.output_dir={straight}"]) == 0
    assert json.loads((straight / "summary.json").read_text())["stopped_on_collapse_at_step"] == 3
    assert main(["train", "bandit", *args, "trainer.total_steps=2", f"trainer.output_dir={cut}"]) == 0
    assert main(["train", "--resume", str(cut), "trainer.total_steps=6"]) == 0
    assert json.loads((cut / "summary.json").read_text())["stopped_on_collapse_at_step"] == 3
    assert [m["step"] for m in _metrics(cut)] == [m["step"] for m in _metrics(straight)]


def test_the_monitor_replayed_from_the_log_equals_the_one_that_ran():
    from ragen.eval.collapse import CollapseMonitor

    history = [{"step": s, "actor/entropy": 0.01, "collapse/in_group_reward_std": 0.0, "actor/grad_norm": g}
               for s, g in enumerate([1.0, 1.1, 0.9, 1.0, 1.2, 1.0], 1)]
    ran, replayed = CollapseMonitor(), CollapseMonitor()
    for metrics in history:
        ran.check(metrics)
    replayed.replay(history)
    assert (replayed._flat_steps, replayed._grad_norms) == (ran._flat_steps, ran._grad_norms) == (6, [1.0, 1.1, 0.9, 1.0, 1.2, 1.0])
    assert ran.collapsed and not replayed.collapsed  # a resume past a collapse stop goes on until the next one
    spike = {"actor/grad_norm": 50.0}
    assert ran.check(spike) == replayed.check(spike) != []


def test_resume_deletes_rollout_logs_of_steps_after_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "bandit", *ARGS, "trainer.total_steps=2", "trainer.val_freq=0", "trainer.log_rollouts_freq=1",
                 f"trainer.output_dir={run}"]) == 0
    orphan = run / "rollouts" / "step_000007.jsonl"  # as a process killed after its last checkpoint leaves them
    orphan.write_text("{}\n")
    mine = sorted(p.name for p in (run / "rollouts").iterdir())
    assert main(["train", "--resume", str(run), "trainer.total_steps=3"]) == 0
    assert not orphan.exists()
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == sorted({*mine, "step_000003.jsonl"} - {orphan.name})


def test_logged_rollouts_take_whole_groups_from_each_tag_in_turn():
    from ragen.agent.trajectory import Trajectory
    from ragen.train.rollout_log import logged_sample

    batch = [Trajectory(env_name="e", group_id=g, seed=0, tag=tag) for tag, g in
             [("A", 0), ("A", 0), ("A", 1), ("A", 1), ("B", 2), ("B", 2), ("B", 3), ("B", 3)]]
    assert [(t.tag, t.group_id) for t in logged_sample(batch, 4)] == [("A", 0), ("A", 0), ("B", 2), ("B", 2)]
    assert logged_sample(batch, 100) == [batch[i] for i in (0, 1, 4, 5, 2, 3, 6, 7)]
