"""What the training loop records: the logged learning rate, validation lines, checkpoint pruning and syncing, plots."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ragen.cli import main
from ragen.train.checkpoint import checkpoint_dir, latest_checkpoint, save_checkpoint

ARGS = ["model=tiny", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
        "trainer.val_episodes=2", "trainer.progress_bar=false", "trainer.plot=false", "trainer.save_final=false",
        "optim.lr=1e-3", "trainer.num_threads=1", "trainer.val_freq=0"]


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_actor_lr_is_the_rate_the_step_trained_with(tmp_path):
    """``actor/lr`` was read after ``scheduler.step()``: the next step's rate (warm-up 4: step 1 trains at lr/4, logged lr/2)."""
    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=2", "optim.warmup_steps=4", "trainer.val_before_train=false",
                 f"trainer.output_dir={run}", *ARGS]) == 0
    assert [line["actor/lr"] for line in _lines(run)] == [1e-3 * 1 / 4, 1e-3 * 2 / 4]
    # with two optimizer steps a training step (mini-batches of 2 of 4 episodes): the mean of the two rates used
    run2 = tmp_path / "run2"
    assert main(["train", "bandit", "trainer.total_steps=1", "optim.warmup_steps=4", "trainer.val_before_train=false",
                 "algorithm.mini_batch_size=2", f"trainer.output_dir={run2}", *ARGS]) == 0
    assert _lines(run2)[0]["actor/lr"] == np.mean([1e-3 * 1 / 4, 1e-3 * 2 / 4])


def test_a_finishing_resume_logs_its_validation_on_the_steps_own_line_once(tmp_path):
    """A resume with no step left validates a step that logged none; that used to append a second line for the step,
    and every further such resume validated again and appended yet another."""
    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=3", "trainer.save_freq=1", "trainer.keep_checkpoints=5",
                 f"trainer.output_dir={run}", *ARGS]) == 0
    shutil.rmtree(checkpoint_dir(run, 3))  # as if killed after step 2's checkpoint
    for _ in range(2):
        assert main(["train", "--resume", str(run), "trainer.total_steps=2"]) == 0
        lines = _lines(run)
        assert [line["step"] for line in lines] == [0, 1, 2]
        assert "actor/entropy" in lines[2] and "val/success" in lines[2]  # step 2's training and its validation
        summary = json.loads((run / "summary.json").read_text())
        assert summary["val_after"] == {k: v for k, v in lines[2].items() if k.startswith("val/")}


def _save(run_dir: Path, step: int, keep: int) -> Path:
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return save_checkpoint(run_dir, step, {"w": param}, optimizer, scheduler, np.random.default_rng(0), extra={}, keep=keep)


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    """A resume that fell back past a damaged newer checkpoint saves older steps than that one: pruning by name then
    deleted the new checkpoint and kept the damaged one, so the next resume had nothing to restore."""
    _save(tmp_path, 3, keep=5)
    damaged = _save(tmp_path, 5, keep=5)
    (damaged / "model.safetensors").write_bytes(b"garbage")
    written = _save(tmp_path, 4, keep=1)  # the resumed run (from step 3) checkpoints step 4
    assert written.is_dir()
    with pytest.warns(UserWarning, match="skipping checkpoint"):  # the damaged step 5 is tried first
        found = latest_checkpoint(tmp_path)
    assert found is not None and found[0] == written


def test_checkpoint_files_are_synced_before_the_checkpoint_is_renamed_into_place(tmp_path, monkeypatch):
    """Only the directories were fsynced: after a power loss a renamed checkpoint (COMPLETE and all) could hold
    files whose contents never reached the disk."""
    synced: set[str] = set()
    real_fsync = os.fsync

    def fsync(fd):
        synced.add(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    final = _save(tmp_path, 1, keep=2)
    assert {p.name for p in final.iterdir()} <= synced


def test_a_run_stopped_on_collapse_ends_with_a_validation_like_any_finished_run(tmp_path, monkeypatch):
    """A collapse stop writes final/ and the summary of a finished run, but had no ``val_after``: not even when its
    last step had validated (``val_freq``), whose numbers were then in metrics.jsonl and not in summary.json."""
    import ragen.train.trainer as trainer_module
    from ragen.eval.collapse import CollapseMonitor

    monkeypatch.setattr(trainer_module, "CollapseMonitor", lambda **kw: CollapseMonitor(entropy_floor=1e9, std_floor=1e9, **kw))
    args = [a for a in ARGS if not a.startswith("trainer.val_freq")] + ["trainer.stop_on_collapse=true",
                                                                        "trainer.total_steps=6"]
    for val_freq in (0, 3):  # stops at step 3: without a validation there, and with one
        run = tmp_path / f"val_freq_{val_freq}"
        assert main(["train", "bandit", *args, f"trainer.val_freq={val_freq}", f"trainer.output_dir={run}"]) == 0
        summary, lines = json.loads((run / "summary.json").read_text()), _lines(run)
        assert summary["stopped_on_collapse_at_step"] == 3 and [line["step"] for line in lines] == [0, 1, 2, 3]
        assert summary["val_after"] == {k: v for k, v in lines[3].items() if k.startswith("val/")}
        assert summary["val_after"]["val/episodes"] > 0


def test_a_checkpoint_write_cut_short_by_a_kill_leaves_no_litter_behind(tmp_path):
    """A SIGKILL while a checkpoint was being assembled left its ``.tmp-step_*`` directory (a whole model and its
    AdamW moments) in ``checkpoints/`` for good: no later save or resume removed it."""
    stale = tmp_path / "checkpoints" / ".tmp-step_000002-k1ll3d"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half a model")
    _save(tmp_path, 1, keep=2)
    _save(tmp_path, 2, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


def test_sampled_validation_leaves_the_training_stream_alone(tmp_path):
    """Sampled validation drew from the global torch RNG that the training rollouts sample from, so validating
    changed every later training step: a run extended by ``--resume trainer.total_steps=4`` (a resume-safe key)
    trained differently from the same run made 4 steps long, because its first session validated at step 2."""
    common = [*ARGS, "trainer.val_do_sample=true", "trainer.save_freq=1", "trainer.val_before_train=false",
              "rollout.temperature=1.0"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main(["train", "bandit", "trainer.total_steps=4", f"trainer.output_dir={straight}", *common]) == 0
    assert main(["train", "bandit", "trainer.total_steps=2", f"trainer.output_dir={cut}", *common]) == 0
    assert main(["train", "--resume", str(cut), "trainer.total_steps=4"]) == 0

    def training(run):
        return [{k: v for k, v in line.items() if not k.startswith(("time/", "val/"))} for line in _lines(run)]

    assert training(cut) == training(straight)
    assert "val/success" in _lines(cut)[1] and "val/success" not in _lines(straight)[1]


def test_a_rollout_log_cut_short_leaves_no_half_written_step_file(tmp_path, monkeypatch):
    from ragen.train import rollout_log

    run = tmp_path / "run"
    calls = []

    def dies_on_the_second_record(value, indent=None):  # as a kill or a full disk part-way through the file
        calls.append(1)
        if len(calls) == 2:
            raise OSError("No space left on device")
        return json.dumps(value)

    monkeypatch.setattr(rollout_log, "strict_dumps", dies_on_the_second_record)
    with pytest.raises(OSError, match="No space"):
        main(["train", "bandit", "trainer.total_steps=1", "trainer.val_before_train=false", "trainer.log_rollouts_freq=1",
              "trainer.log_rollouts_n=4", f"trainer.output_dir={run}", *ARGS])
    assert list((run / "rollouts").iterdir()) == []  # before: step_000001.jsonl with one of its four records


def test_a_plot_that_cannot_be_written_does_not_lose_the_runs_summary(tmp_path, monkeypatch):
    import ragen.viz.plots as plots

    monkeypatch.setattr(plots, "plot_runs", lambda runs: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    run = tmp_path / "run"
    args = [a for a in ARGS if a != "trainer.plot=false"]
    assert main(["train", "bandit", "trainer.total_steps=1", "trainer.val_before_train=false", f"trainer.output_dir={run}", *args]) == 0
    assert json.loads((run / "summary.json").read_text())["plot"].startswith("not drawn: OSError")
