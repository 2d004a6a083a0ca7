"""The checks a run makes before it loads a model, runnable alone: ``ragen train --print-config``.

:func:`preflight` raises what :class:`~ragen.train.trainer.StarPOTrainer` would raise at start-up for the
same config -- a missing optional package (vLLM, Ray, wandb, tensorboard), an env config its env rejects,
an unknown estimator or loss, an unusable ``trainer.device``, a model spec naming nothing loadable, an
output dir holding a run -- without loading weights, starting Ray or writing a file. The trainer runs the
same functions itself (not this one: it keeps what they build), so a config that passes here fails later
only for reasons that need the model or the run itself (memory, a damaged weights file, a GPU's state).
"""

from __future__ import annotations

from pathlib import Path

from ragen.algos import get_adv_estimator, get_policy_loss
from ragen.config import RunConfig, taken_run_entries
from ragen.models.device import resolve_device
from ragen.train.env_sets import Slots, train_sets, val_sets
from ragen.train.loggers import require_logger_packages

#: What a run writes into its ``trainer.output_dir`` (a new run refuses a dir already holding any of them).
RUN_DIR_ENTRIES = ("config.yaml", "summary.json", "curves.png", "final", "checkpoints", "rollouts", "tensorboard", "wandb")


def run_dir_problem(path: Path) -> str | None:
    """Why a *new* run may not start in ``path`` (one line naming the file), or None."""
    if path.exists() and not path.is_dir():
        return f"trainer.output_dir {path} is a file, not a directory; choose another trainer.output_dir"
    if (path / "metrics.jsonl").exists():
        return f"run dir {path} already holds a run (metrics.jsonl); choose another trainer.output_dir"
    if taken := taken_run_entries(path, RUN_DIR_ENTRIES):  # never over a user's own files of these names
        return (f"trainer.output_dir {path} already has {taken[0]!r}, which the run would overwrite; "
                "choose another trainer.output_dir")
    return None


def check_model_spec(spec: str) -> None:
    """Raise unless ``spec`` names a loadable model, without loading it (nor converting the embedded one)."""
    from ragen.models.embedded import EMBEDDED_NAME, gguf_path
    from ragen.models.loading import resolve_model_path
    from ragen.models.tiny import TINY_NAME

    if spec == EMBEDDED_NAME:
        gguf_path()  # FileNotFoundError with the install hint when the model wheel is missing
    elif spec != TINY_NAME:
        resolve_model_path(spec)  # ModelLoadError: not a model directory


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
    check_model_spec(config.model)
    if not resume and config.trainer.output_dir:  # an empty output_dir is a fresh runs/NAME-TIME dir
        problem = run_dir_problem(Path(config.trainer.output_dir))
        if problem:
            raise FileExistsError(problem)
