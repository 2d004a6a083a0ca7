"""A run's config on disk: the resolved ``config.yaml`` a run writes, and which keys may change on ``--resume``
without changing results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ragen.config_schema import RunConfig


#: Keys that may change on ``--resume`` without changing the results of the steps already run.
RESUME_SAFE_KEYS = {
    "trainer.total_steps", "trainer.progress_bar", "trainer.log_rollouts_freq", "trainer.log_rollouts_n",
    "trainer.save_freq", "trainer.keep_checkpoints", "trainer.output_dir", "trainer.num_threads",
    "trainer.logger", "trainer.plot", "trainer.fsdp",
    # same results up to float rounding (tests/models/test_checkpointing.py, tests/train/test_micro_batches.py):
    # the fixes after an OOM kill
    "trainer.gradient_checkpointing", "algorithm.micro_batch_size", "algorithm.max_tokens_per_micro_batch",
}


def flat_config(config: Any) -> dict[str, Any]:
    """A structured config (``RunConfig``, ``SFTConfig``) as ``{dotted key: leaf value}``."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(OmegaConf.structured(config)), "")
    return out


def result_changing_differences(old: RunConfig, new: RunConfig) -> list[str]:
    """Dotted keys whose values differ between two configs, ignoring :data:`RESUME_SAFE_KEYS`."""
    a, b = flat_config(old), flat_config(new)
    return sorted(k for k in a.keys() | b.keys() if not resume_safe(k, b) and a.get(k) != b.get(k))


def resume_safe(key: str, config: dict[str, Any], safe_keys: set[str] = RESUME_SAFE_KEYS) -> bool:
    """Whether ``key`` (of the flat ``config``) may change on resume: one of ``safe_keys``, except where dropout would
    draw other masks: the micro-batch size (masks per micro-batch; ``*.micro_batch_size`` of RL and SFT) and
    ``trainer.fsdp`` (its padding passes draw too), under LoRA dropout or, in RL, with the model's own dropout left
    on (``algorithm.disable_dropout=false``: the model may have some; its config is not read here)."""
    if key.endswith((".micro_batch_size", ".max_tokens_per_micro_batch")) or key == "trainer.fsdp":
        if config.get("lora.rank", 0) > 0 and config.get("lora.dropout", 0) > 0:
            return False
        if config.get("algorithm.disable_dropout") is False:
            return False
    return key in safe_keys


#: First line of every ``config.yaml`` a run writes: a YAML comment, so the file loads the same, but it tells a
#: run's own file from a user's (:func:`written_by_ragen`).
RUN_CONFIG_HEADER = "# ragen: this run's resolved config, written when the run started\n"


def written_by_ragen(path: str | Path) -> bool:
    """Whether ``path`` is a ``config.yaml`` a ragen run wrote (its first line is :data:`RUN_CONFIG_HEADER`)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline() == RUN_CONFIG_HEADER
    except (OSError, UnicodeDecodeError):
        return False


def taken_run_entries(run_dir: Path, entries: tuple[str, ...]) -> list[str]:
    """Of ``entries`` (what a run writes into its dir), those ``run_dir`` already holds, in order.

    A ``config.yaml`` that ragen wrote, alone, does not count: that run stopped before it logged a
    step, and a new run starts it over (``docs/design.md``, "A run owns the files it writes").
    """
    taken = [name for name in entries if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    if taken == ["config.yaml"] and written_by_ragen(run_dir / "config.yaml"):
        return []
    return taken


def to_yaml(config: RunConfig) -> str:
    return RUN_CONFIG_HEADER + OmegaConf.to_yaml(OmegaConf.structured(config))
