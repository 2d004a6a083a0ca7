"""trainer.logger: TensorBoard scalars equal metrics.jsonl (also across --resume); bad or missing loggers exit 2."""

import importlib.util
import json
import math
import shutil
import sys

import numpy as np
import pytest

from ragen.cli import main
from ragen.config import ConfigError, load_config

ARGS = ["model=tiny", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
        "trainer.val_episodes=2", "trainer.progress_bar=false", "trainer.save_final=false", "trainer.plot=false",
        "optim.lr=1e-3", "trainer.num_threads=1"]


def _jsonl(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tensorboard(run_dir) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows: every scalar tag's (step, value) events, after its purge of orphaned steps."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={SCALARS: 0})  # 0 = keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _assert_tensorboard_equals_jsonl(run_dir) -> None:
    expected: dict[str, list[tuple[int, float]]] = {}
    for line in _jsonl(run_dir):
        for key, value in line.items():
            if key != "step" and isinstance(value, (int, float)):
                expected.setdefault(key, []).append((line["step"], float(np.float32(value))))  # TB stores float32
    scalars = _tensorboard(run_dir)
    assert set(scalars) == set(expected)
    for tag, events in expected.items():
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in events], tag
        assert all(_same(g, e) for (_, g), (_, e) in zip(got, events)), (tag, got, events)


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=2", f"trainer.output_dir={run}", *ARGS,
                 "trainer.logger=[console,jsonl,tensorboard]"]) == 0
    assert [line["step"] for line in _jsonl(run)] == [0, 1, 2]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    _assert_tensorboard_equals_jsonl(run)
    assert "actor/grad_norm" in _tensorboard(run) and "val/success" in _tensorboard(run)


def test_resume_appends_without_duplicated_steps(tmp_path):
    """A run "killed" after step 3 with its newest checkpoint at step 1 reruns steps 2-3: TensorBoard shows them once."""
    run = tmp_path / "run"
    # jsonl is not listed: metrics.jsonl is written anyway.
    common = [*ARGS, "trainer.logger=[tensorboard]", "trainer.save_freq=1", "trainer.keep_checkpoints=5"]
    assert main(["train", "bandit", "trainer.total_steps=3", f"trainer.output_dir={run}", *common]) == 0
    before = _tensorboard(run)
    for step in (2, 3):
        shutil.rmtree(run / "checkpoints" / f"step_{step:06d}")
    assert main(["train", "--resume", str(run)]) == 0
    assert [line["step"] for line in _jsonl(run)] == [0, 1, 2, 3]
    _assert_tensorboard_equals_jsonl(run)
    # Step times differ between processes: step 1 is the first process's, steps 2-3 the rerun's.
    after = _tensorboard(run)
    assert after["time/step_s"][0] == before["time/step_s"][0]
    assert all(a != b for a, b in zip(after["time/step_s"][1:], before["time/step_s"][1:]))
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_unknown_logger_exits_2_naming_the_key(tmp_path, capsys):
    with pytest.raises(ConfigError, match="trainer.logger.*'mlflow'"):
        load_config("bandit", ["trainer.logger=[console,mlflow]"])
    assert main(["train", "bandit", f"trainer.output_dir={tmp_path / 'run'}", *ARGS, "trainer.logger=[console,mlflow]"]) == 2
    err = capsys.readouterr().err
    assert "'trainer.logger'" in err and "'mlflow'" in err and "tensorboard" in err
    assert load_config("bandit").trainer.logger == ["console", "jsonl"]


def test_wandb_requested_but_not_installed_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, installed or not
    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=1", f"trainer.output_dir={run}", *ARGS,
                 "trainer.logger=[console,wandb]"]) == 2
    err = capsys.readouterr().err
    assert "'trainer.logger'" in err and "wandb" in err and "not installed" in err
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (optional extra: ragen[wandb])")
def test_wandb_offline_writes_under_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = tmp_path / "run"
    assert main(["train", "bandit", "trainer.total_steps=1", f"trainer.output_dir={run}", *ARGS,
                 "trainer.logger=[console,wandb]"]) == 0
    assert [line["step"] for line in _jsonl(run)] == [0, 1]
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))


def test_metrics_jsonl_is_strict_json_with_null_for_nan(tmp_path):
    import math

    from ragen.train.loggers import JsonlLogger
    from ragen.viz.plots import load_curves

    logger = JsonlLogger(tmp_path / "metrics.jsonl")
    for step, value in enumerate([0.5, math.nan, math.inf, 0.25], 1):
        logger.log({"step": step, "critic/explained_variance": value}, step=step)

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    lines = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["critic/explained_variance"] for line in lines] == [0.5, None, None, 0.25]
    curve = load_curves(tmp_path)["critic/explained_variance"]  # a null is a gap in the plot, not a dropped point
    assert [x for x, _ in curve] == [1.0, 2.0, 3.0, 4.0] and sum(math.isnan(y) for _, y in curve) == 2
