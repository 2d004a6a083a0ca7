"""The typed SFT configuration: one schema, validated at construction, like :mod:`ragen.config`.

``load_sft_config(data, overrides)`` merges the schema's defaults, an optional YAML file
(a previous run's ``config.yaml``) and ``key=value`` overrides. An unknown key or a value
of the wrong type raises :class:`ragen.config.ConfigError` naming the key; the CLI prints
it as one line and exits 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ragen.config import (RUN_CONFIG_HEADER, AdamWConfig, ConfigError, LoraConfig, _friendly, _wrong_container, absolute_path,
                          checkpointing_setting,
                          builtin_model_names, flat_config, load_yaml_mapping, overrides_layer, resume_safe)
from ragen.models.device import check_device_spec
from ragen.models.precision import PRECISIONS, resolve_precision


@dataclass
class SFTDataConfig:
    #: JSONL file of chat records (``ragen sft generate``); set from the command line's DATA.
    path: str = ""
    #: Share of the conversations held out for the eval loss (at least one is held out).
    eval_fraction: float = 0.05
    #: At most this many held-out conversations.
    eval_max: int = 64
    #: Conversations longer than this many tokens are dropped (counted in ``summary.json``).
    max_length: int = 2048
    #: Train on the EOS that closes each assistant turn (when the template closes turns with it).
    train_on_eos: bool = True


@dataclass
class SFTOptimConfig(AdamWConfig):
    #: AdamW's peak learning rate (after warm-up).
    lr: float = 1e-4
    #: Linear warm-up steps.
    warmup_steps: int = 10
    #: "cosine" (decay to ``min_lr_ratio * lr`` at the last step) or "constant" (after warm-up).
    schedule: str = "cosine"
    #: The cosine schedule's final rate, as a share of ``lr``.
    min_lr_ratio: float = 0.1


@dataclass
class SFTTrainerConfig:
    #: Passes over the training split (ignored when ``max_steps > 0``).
    epochs: int = 1
    #: Optimizer steps (0 = ``epochs`` passes over the data).
    max_steps: int = 0
    #: Conversations per optimizer step.
    batch_size: int = 16
    #: Conversations per forward/backward pass (gradient accumulation inside a step).
    micro_batch_size: int = 4
    #: "auto" (bf16 only where the hardware multiplies bf16 natively; see ragen/models/precision.py),
    #: "bf16" (autocast, fp32 master weights) or "fp32". The resolved value is what config.yaml records.
    precision: str = "auto"
    #: "auto" (``cuda:LOCAL_RANK`` when a CUDA GPU is visible, else cpu), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    #: Eval loss every N steps (0 = only before training and at the end).
    eval_freq: int = 0
    #: Run directory; empty = ``runs/sft-<timestamp>``.
    output_dir: str = ""
    #: Checkpoint every N steps (0 = never; Ctrl-C always saves one); see ``ragen sft train --resume``.
    save_freq: int = 0
    #: Checkpoints kept on disk, the newest (0 = every one).
    keep_checkpoints: int = 2
    #: Stop after this many seconds of training (0 = no limit); the final weights are saved as usual.
    max_time_s: float = 0.0
    #: Save the final weights (or LoRA adapter) and tokenizer to ``<output_dir>/final``.
    save_final: bool = True
    #: Show a tqdm progress bar.
    progress_bar: bool = True
    #: torch threads (0 = torch's default).
    num_threads: int = 0
    #: Tokens per forward/backward pass at most, padding included (rows × longest row; 0 = no bound): the memory
    #: knob, since activations grow with tokens. Short chats run ``micro_batch_size`` to a pass, long ones fewer;
    #: a chat longer than this runs alone (ragen/train/micro_batches.py). The loss is the same however they are cut.
    max_tokens_per_micro_batch: int = 2048
    #: Activation checkpointing: keep only each decoder layer's input and recompute the layer in the
    #: backward pass (ragen/models/checkpointing.py): far less memory on long chats for about one
    #: extra forward pass per step. ``auto``: on for a step whose longest chat exceeds
    #: ``max_tokens_per_micro_batch``; ``true`` / ``false``: always / never.
    gradient_checkpointing: str = "auto"


@dataclass
class SFTConfig:
    #: ``smollm2-135m`` (embedded default), ``tiny`` (tests), an HF model dir or a ragen run dir.
    model: str = "smollm2-135m"
    #: Seeds the data split, the shuffle and torch.
    seed: int = 0
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    #: ``lora.rank=0`` fine-tunes every weight; ``> 0`` trains LoRA adapters (peft).
    lora: LoraConfig = field(default_factory=LoraConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


def load_sft_config(yaml_path: str | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                    check: bool = True) -> SFTConfig:
    """Defaults ← optional YAML ← ``key=value`` overrides, validated; returns an :class:`SFTConfig`.

    A YAML file that is not a mapping of known keys (a syntax error, bytes that are not UTF-8,
    a list at the top, an unknown key) raises :class:`ConfigError` naming the file.
    ``check=False`` skips :func:`validate` (types are still checked): the saved config of a run
    whose data file has moved still loads, e.g. to compare it with the resumed one.
    """
    merged = OmegaConf.structured(SFTConfig)
    if yaml_path:
        if not Path(yaml_path).is_file():
            raise ConfigError(f"config file not found: {yaml_path}")
        layer = load_yaml_mapping(yaml_path)
        try:  # the file's own mistakes name the file
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"config file {yaml_path}: {_friendly(exc)}") from None
        except TypeError:
            raise ConfigError(f"config file {yaml_path}: a list where the config has a mapping, "
                              "or a mapping where it has a list") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
    schema = merged
    try:
        merged = OmegaConf.merge(merged, overrides_layer(overrides))
        config: SFTConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_friendly(exc)) from None
    except TypeError:
        raise ConfigError(_wrong_container(schema, [], overrides, None)) from None  # the file merged above
    config.model = absolute_path(config.model, keep=builtin_model_names())
    config.data.path = absolute_path(config.data.path)
    if check:
        validate(config)
    return config


#: Keys that may change on ``ragen sft train --resume`` without changing the steps already run
#: (``max_steps``/``epochs`` extend or shorten the run, as ``trainer.total_steps`` does for RL runs).
RESUME_SAFE_KEYS = {
    "trainer.max_steps", "trainer.epochs", "trainer.progress_bar", "trainer.eval_freq", "trainer.output_dir",
    "trainer.save_freq", "trainer.keep_checkpoints", "trainer.max_time_s", "trainer.save_final",
    "trainer.num_threads",
    # same results up to float rounding (tests/models/test_checkpointing.py, tests/sft/test_train.py): the fixes
    # after an OOM kill
    "trainer.gradient_checkpointing", "trainer.micro_batch_size", "trainer.max_tokens_per_micro_batch",
}


def result_changing_differences(old: SFTConfig, new: SFTConfig) -> list[str]:
    """Dotted keys whose values differ between two SFT configs, ignoring :data:`RESUME_SAFE_KEYS`."""

    def flat(config: SFTConfig) -> dict:
        out = flat_config(config)
        if out.get("trainer.precision") in PRECISIONS and check_device_spec(out.get("trainer.device")) is None:
            out["trainer.precision"] = resolve_precision(out["trainer.precision"], out["trainer.device"])
        return out

    a, b = flat(old), flat(new)
    return sorted(k for k in a.keys() | b.keys() if not resume_safe(k, b, RESUME_SAFE_KEYS) and a.get(k) != b.get(k))


def validate(config: SFTConfig) -> None:
    """Cross-field checks that types alone cannot express (each names its key)."""

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"config key {key!r}: {why}")

    need(bool(config.data.path), "data.path", "no data file given")
    need(Path(config.data.path).is_file(), "data.path", f"file not found: {config.data.path}")
    need(0 < config.data.eval_fraction < 1, "data.eval_fraction", "must be in (0, 1)")
    need(config.data.eval_max >= 1, "data.eval_max", "must be >= 1")
    need(config.data.max_length >= 2, "data.max_length", "must be >= 2")
    need(config.optim.lr > 0, "optim.lr", "must be > 0")
    need(config.optim.grad_clip > 0, "optim.grad_clip", "must be > 0 (the largest gradient norm; inf = no clipping)")
    need(config.optim.schedule in ("cosine", "constant"), "optim.schedule", "must be 'cosine' or 'constant'")
    need(0 <= config.optim.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
    need(config.optim.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    need(config.trainer.epochs >= 1, "trainer.epochs", "must be >= 1")
    need(config.trainer.max_steps >= 0, "trainer.max_steps", "must be >= 0")
    need(config.trainer.batch_size >= 1, "trainer.batch_size", "must be >= 1")
    need(config.trainer.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1")
    need(config.trainer.max_tokens_per_micro_batch >= 0, "trainer.max_tokens_per_micro_batch", "must be >= 0 (0: no bound)")
    config.trainer.gradient_checkpointing = checkpointing_setting(config.trainer.gradient_checkpointing,
                                                                  "trainer.gradient_checkpointing")
    need(config.trainer.precision in PRECISIONS, "trainer.precision", f"must be one of {', '.join(PRECISIONS)}")
    need(check_device_spec(config.trainer.device) is None, "trainer.device", str(check_device_spec(config.trainer.device)))
    config.trainer.precision = resolve_precision(config.trainer.precision, config.trainer.device)
    need(config.trainer.max_time_s >= 0, "trainer.max_time_s", "must be >= 0")
    need(config.lora.rank >= 0, "lora.rank", "must be >= 0")


def to_yaml(config: SFTConfig) -> str:
    return RUN_CONFIG_HEADER + OmegaConf.to_yaml(OmegaConf.structured(config))


__all__ = ["SFTConfig", "SFTDataConfig", "SFTOptimConfig", "SFTTrainerConfig", "load_sft_config", "validate", "to_yaml",
           "RESUME_SAFE_KEYS", "result_changing_differences"]
