"""Where a run's per-step metrics go: ``trainer.logger`` (see ``docs/logging.md``).

Every logger takes the trainer's metrics dict of one step (the same dict that becomes a line of
``metrics.jsonl``) and the step number. ``metrics.jsonl`` is always written, listed or not: the
viewer, ``ragen plot`` and ``--resume`` read it.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ragen.files import strict_dumps, strict_json, write_text_atomic

if TYPE_CHECKING:
    from ragen.config import RunConfig

#: Accepted names of ``trainer.logger``.
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")

WANDB_MISSING = ("config key 'trainer.logger': 'wandb' needs the wandb package, which is not installed "
                 "(pip install 'ragen[wandb]', or drop wandb from trainer.logger)")


class Logger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def unknown_loggers(names: list[str]) -> list[str]:
    return [n for n in names if n not in LOGGERS]


def require_logger_packages(names: list[str]) -> None:
    """Raise :class:`~ragen.config.ConfigError` (exit 2 in the CLI) when a requested logger's package is missing."""
    from ragen.errors import ConfigError

    if "wandb" in names:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(WANDB_MISSING) from None
    if "tensorboard" in names:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise ConfigError("config key 'trainer.logger': 'tensorboard' needs the tensorboard package "
                              "(pip install tensorboard)") from None


def build_loggers(config: "RunConfig", run_dir: Path, metrics_path: Path, resume_step: int | None = None) -> list[Logger]:
    """The loggers ``config.trainer.logger`` asks for, JSONL first and always.

    ``resume_step``: the checkpoint step a resumed run continues from (None = a fresh run);
    loggers drop or overwrite what they hold for later steps.
    """
    names = config.trainer.logger
    require_logger_packages(names)
    loggers: list[Logger] = [JsonlLogger(metrics_path)]
    if "tensorboard" in names:
        loggers.append(TensorBoardLogger(run_dir / "tensorboard", resume_step))
    if "wandb" in names:
        loggers.append(WandbLogger(config, run_dir, resume_step))
    # "console": the progress bar and validation lines the trainer prints itself (no extra output).
    return loggers


def numeric(metrics: dict) -> dict[str, float]:
    """The scalar metrics other than ``step`` (bools count as 0/1; strings and the like are skipped)."""
    return {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}


class JsonlLogger:
    """``RUN_DIR/metrics.jsonl``: the metrics dict of each step as one JSON line, appended.

    One line per step: metrics of the step the last line already holds (a finishing ``--resume`` validating the
    step a run stopped at) are merged into that line, and the file is rewritten atomically.
    """

    def __init__(self, path: Path):
        self.path = path
        self.last_step: int | None = None  # the step of the file's last line, once read

    def log(self, metrics: dict[str, float], step: int) -> None:
        line = metrics if "step" in metrics else {"step": step, **metrics}
        if self.last_step is None and self.path.is_file():  # a resumed run: the log so far (truncated by the resume)
            lines = [text for text in self.path.read_text().splitlines() if text.strip()]
            self.last_step = json.loads(lines[-1]).get("step") if lines else None
        if line["step"] == self.last_step:
            lines = [text for text in self.path.read_text().splitlines() if text.strip()]
            merged = {**json.loads(lines[-1]), **strict_json(line)}
            write_text_atomic(self.path, "".join(text + "\n" for text in [*lines[:-1], strict_dumps(merged)]))
            return
        with self.path.open("a") as f:  # strict JSON: NaN/inf as null (jq, JavaScript and pandas read every line)
            f.write(strict_dumps(line) + "\n")
        self.last_step = line["step"]

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Scalars under ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``).

    On resume, ``purge_step`` makes TensorBoard drop the events a killed run wrote after its
    checkpoint, so every step appears once. Flushed after every step (steps take seconds).
    """

    def __init__(self, log_dir: Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=None if resume_step is None else resume_step + 1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in numeric(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_run_id(id_file: Path) -> str:
    """The wandb run id kept in ``id_file`` (``--resume`` continues that wandb run); a new one is made and saved
    when there is none.

    Written atomically: a kill mid-write must not leave an empty file, whose id would be lost on resume. A blank
    file (left by a non-atomic write of an older version) counts as none.
    """
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    if not run_id:
        run_id = secrets.token_hex(4)
        write_text_atomic(id_file, run_id + "\n")  # creates the directory too
    return run_id


class WandbLogger:
    """Weights & Biases, files under ``RUN_DIR/wandb``; offline unless ``WANDB_API_KEY`` or ``WANDB_MODE`` says otherwise.

    The run id is kept in ``RUN_DIR/wandb/ragen_run_id`` so ``--resume`` continues the same wandb run.
    """

    def __init__(self, config: "RunConfig", run_dir: Path, resume_step: int | None = None):
        from dataclasses import asdict

        try:
            import wandb
        except ImportError:
            from ragen.errors import ConfigError

            raise ConfigError(WANDB_MISSING) from None
        run_id = wandb_run_id(run_dir / "wandb" / "ragen_run_id")
        # No WANDB_MODE and no API key: this machine cannot log in, so record offline (`wandb sync` later).
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "ragen"), name=run_dir.name, id=run_id, resume="allow",
            dir=str(run_dir), mode=mode, config=asdict(config),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(numeric(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
