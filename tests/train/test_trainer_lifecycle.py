"""Whatever ends a run -- an exception, a refused resume, a refused start-up -- leaves no Ctrl-C handler, open logger,
Ray worker or process group behind; each test failed before its fix."""

import signal

import pytest

import ragen.train.distributed as distributed
import ragen.train.ray_rollout as ray_rollout
from ragen.cli import main
from ragen.config import load_config
from ragen.train.trainer import StarPOTrainer

ARGS = ["model=tiny", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "trainer.val_episodes=2",
        "trainer.progress_bar=false", "trainer.plot=false", "trainer.save_final=false", "trainer.num_threads=1"]


class FakePool:
    """Stands in for RayRolloutPool: records what the trainer asks of it."""

    def __init__(self, config=None):
        self.calls: list[str] = []

    def run(self, *args, **kwargs):
        self.calls.append("run")
        raise RuntimeError("a worker died")

    def close(self):
        self.calls.append("close")


class RecordingLogger:
    def __init__(self):
        self.closed = 0

    def log(self, metrics, step):
        pass

    def close(self):
        self.closed += 1


def test_an_exception_in_train_restores_ctrl_c_and_closes_loggers_and_the_pool(tmp_path):
    trainer = StarPOTrainer(load_config("bandit", [*ARGS, "trainer.val_before_train=false", f"trainer.output_dir={tmp_path / 'run'}"]))
    pool, logger = FakePool(), RecordingLogger()
    trainer.rollout_pool, trainer.loggers = pool, [*trainer.loggers, logger]
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="a worker died"):
        trainer.train()
    assert signal.getsignal(signal.SIGINT) is handler  # before: the run's handler stayed, Ctrl-C no longer stopped
    assert pool.calls == ["run", "close"] and trainer.rollout_pool is None
    assert logger.closed == 1


def test_a_run_of_zero_steps_validates_on_the_pool_before_closing_it(tmp_path):
    trainer = StarPOTrainer(load_config("bandit", [*ARGS, "trainer.total_steps=0", "trainer.val_before_train=false",
                                                   f"trainer.output_dir={tmp_path / 'run'}"]))
    pool = trainer.rollout_pool = FakePool()
    with pytest.raises(RuntimeError, match="a worker died"):  # the validation went to the pool (before: locally)
        trainer.train()
    assert pool.calls == ["run", "close"]


def test_a_refused_resume_closes_the_pool_it_started(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert main(["train", "bandit", *ARGS, "trainer.total_steps=1", "trainer.val_before_train=false",
                 "trainer.save_freq=1", f"trainer.output_dir={run}"]) == 0
    pools = []

    class StartedPool(FakePool):
        check = staticmethod(lambda config: None)  # Ray need not be installed

        def __init__(self, config):
            super().__init__()
            pools.append(self)

    monkeypatch.setattr(ray_rollout, "RayRolloutPool", StartedPool)
    monkeypatch.setattr(StarPOTrainer, "_resume", lambda self: (_ for _ in ()).throw(ValueError("checkpoint refused")))
    config = load_config("bandit", [*ARGS, "rollout.backend=ray", f"trainer.output_dir={run}"])
    with pytest.raises(ValueError, match="checkpoint refused"):
        StarPOTrainer(config, resume=True)
    assert [p.calls for p in pools] == [["close"]]


def test_a_refused_start_up_still_leaves_the_process_group(tmp_path, monkeypatch):
    closed = []
    monkeypatch.setattr(distributed, "close_distributed", lambda: closed.append(1))

    def refuse(self, config, resume=False):  # as a trainer refusing its run dir after joining torchrun's group
        raise FileNotFoundError("no valid checkpoint")

    monkeypatch.setattr(StarPOTrainer, "__init__", refuse)
    assert main(["train", "bandit", *ARGS, f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    assert closed == [1]
