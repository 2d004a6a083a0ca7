"""The checks an SFT run makes before it loads a model, runnable alone: ``ragen sft train --print-config``.

:func:`preflight` raises what :class:`~ragen.sft.trainer.SFTTrainer` would raise at start-up: an output dir
it may not use, an unusable ``trainer.device``, a model spec naming nothing loadable, a data file that is
empty or holds a line that is not a conversation (``FILE:LINE``). Limits that need the tokenizer
(``data.max_length``) are checked when the run starts.
"""

from __future__ import annotations

from pathlib import Path

from ragen.config import taken_run_entries
from ragen.files import file_sha256
from ragen.models.device import resolve_device
from ragen.models.loading import check_model
from ragen.train.preflight import check_resumable, not_a_directory
from ragen.sft.config import SFTConfig
from ragen.sft.data import record_problem
from ragen.sft.generate import iter_jsonl

#: What an SFT run writes into its dir: a new (non-resume) run refuses a dir that holds any of them.
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "final")


def check_run_dir(path: Path, resume: bool) -> None:
    """Raise unless an SFT run may use ``path``: a new run's dir must not hold a :data:`RUN_FILES` entry
    (other files are left alone), a resumed run's dir must exist."""
    if problem := not_a_directory(path):
        raise FileExistsError(problem)
    if resume:
        if not path.is_dir():
            raise FileNotFoundError(f"--resume {path}: no such run directory")
        return
    taken = taken_run_entries(path, RUN_FILES)
    if taken:
        hint = f" (`ragen sft train --resume {path}` continues the run there)" if (path / "checkpoints").is_dir() else ""
        raise FileExistsError(f"trainer.output_dir {path} already holds {taken[0]}, which this run would overwrite; "
                              f"choose another trainer.output_dir{hint}")


def check_data(path: str) -> None:
    """Raise ``ValueError`` naming ``FILE:LINE`` unless every line of ``path`` is a training conversation."""
    count = 0
    for number, record in iter_jsonl(path):
        problem = record_problem(record)
        if problem:
            raise ValueError(f"{path}:{number}: {problem}")
        count += 1
    if not count:
        raise ValueError(f"{path}: no records")


def data_change_problem(checkpoint: Path, state: dict, data_path: str, sha256: str | None = None) -> str | None:
    """Why resuming from ``checkpoint`` (its ``state.json`` as ``state``) on ``data_path`` would train on other
    conversations, or None: the checkpoint's ``data_sha256`` (checkpoints
    without one pass) against the file's now (``sha256`` if the caller hashed it already)."""
    saved = state.get("data_sha256")
    if saved is None:
        return None
    now = sha256 or file_sha256(data_path)
    if saved == now:
        return None
    return (f"--resume: {data_path} changed since {checkpoint.name} was written (sha256 {saved[:12]}… then, "
            f"{now[:12]}… now): the run would go on with other conversations; pass --force to accept")


def preflight(config: SFTConfig, resume: bool = False, force: bool = False) -> None:
    """Raise the error an SFT run of ``config`` would stop on at start-up (see the module docstring)."""
    if config.trainer.output_dir:  # empty: a fresh runs/sft-TIME dir
        check_run_dir(Path(config.trainer.output_dir), resume)
    checkpoint = check_resumable(Path(config.trainer.output_dir)) if resume else None
    resolve_device(config.trainer.device)
    check_model(config.model)
    check_data(config.data.path)
    problem = checkpoint and not force and data_change_problem(*checkpoint, config.data.path)
    if problem:
        raise ValueError(problem)
