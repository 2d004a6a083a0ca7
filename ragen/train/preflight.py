"""The checks a run makes before it loads a model, runnable alone: ``ragen train --print-config``.

:func:`preflight` raises what :class:`~ragen.train.trainer.StarPOTrainer` would raise at start-up for the
same config -- a missing optional package (vLLM, Ray, wandb, tensorboard), an env config its env rejects,
an unknown estimator or loss, an unusable ``trainer.device``, a model spec naming nothing loadable, an
output dir holding a run -- without loading weights, starting Ray or writing a file. The trainer makes the
same checks with the same functions before it loads the model (the model's own through
:func:`~ragen.models.loading.load_model`, which :func:`~ragen.models.loading.check_model` mirrors without
loading), so a config that passes here fails later only for reasons that need the weights or the run itself
(memory, a damaged weights file, a GPU's state).
"""

from __future__ import annotations

from pathlib import Path

from ragen.algos import get_adv_estimator, get_policy_loss
from ragen.config import RunConfig, taken_run_entries
from ragen.files import file_in_the_way
from ragen.models.device import resolve_device
from ragen.models.loading import check_model
from ragen.train.checkpoint import latest_checkpoint, metrics_to_keep, no_checkpoint
from ragen.agent.env_sets import Slots, train_sets, val_sets
from ragen.train.loggers import require_logger_packages

#: What a run writes into its ``trainer.output_dir`` (a new run refuses a dir already holding any of them).
RUN_DIR_ENTRIES = ("config.yaml", "summary.json", "curves.png", "final", "checkpoints", "rollouts", "tensorboard", "wandb")


def not_a_directory(path: Path) -> str | None:
    """Why ``trainer.output_dir`` ``path`` cannot be a directory (it, or a parent, is a file), or None (RL and SFT)."""
    if blocker := file_in_the_way(path):
        where = "is a file" if blocker == path.absolute() else f"is under a file ({blocker})"
        return f"trainer.output_dir {path} {where}, not a directory; choose another trainer.output_dir"
    return None


def run_dir_problem(path: Path) -> str | None:
    """Why a *new* run may not start in ``path`` (one line naming the file), or None."""
    if problem := not_a_directory(path):
        return problem
    if (path / "metrics.jsonl").exists():
        return f"run dir {path} already holds a run (metrics.jsonl); choose another trainer.output_dir"
    if taken := taken_run_entries(path, RUN_DIR_ENTRIES):  # never over a user's own files of these names
        return (f"trainer.output_dir {path} already has {taken[0]!r}, which the run would overwrite; "
                "choose another trainer.output_dir")
    return None


def check_resumable(run_dir: Path) -> tuple[Path, dict]:
    """Raise what ``--resume run_dir`` would stop on before training: no valid checkpoint (reads the newest ones,
    as the resume does), or a damaged ``metrics.jsonl`` (checked, not trimmed). Returns the checkpoint the resume
    would restore: ``(path, its state.json)``."""
    found = latest_checkpoint(run_dir)
    if found is None:
        raise no_checkpoint(run_dir)
    metrics_to_keep(run_dir / "metrics.jsonl", int(found[1]["state"]["step"]))
    return found[0], found[1]["state"]


def preflight(config: RunConfig, resume: bool = False) -> None:
    """Raise the error a run of ``config`` would stop on at start-up (see the module docstring)."""
    r = config.rollout
    if r.engine == "vllm":
        from ragen.models.vllm_backend import check_vllm_run

        check_vllm_run(config)
    if r.backend == "ray":
        from ragen.train.ray_rollout import RayRolloutPool

        RayRolloutPool.check(config)
    require_logger_packages(config.trainer.logger)
    Slots.build(train_sets(config), r.group_size)  # builds every env once: an env's own config check
    Slots.build(val_sets(config), 1)
    get_adv_estimator(config.algorithm.adv_estimator)
    get_policy_loss(config.algorithm.policy_loss)
    resolve_device(config.trainer.device)
    check_model(config.model)
    if resume:
        check_resumable(Path(config.trainer.output_dir))
    elif config.trainer.output_dir:  # an empty output_dir is a fresh runs/NAME-TIME dir
        problem = run_dir_problem(Path(config.trainer.output_dir))
        if problem:
            raise FileExistsError(problem)
