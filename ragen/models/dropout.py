"""Dropout off in the policy for RL updates (``algorithm.disable_dropout``, on by default).

PPO's ratio ``π_θ(a|s) / π_old(a|s)`` and the KL terms compare the policy with itself: ``π_old`` is scored
in eval mode (no dropout) before the update, and the update's forward runs in training mode. With dropout
on, the first step's ratio is not 1 and its clipping fires on dropout noise, and gradient accumulation over
micro-batches draws other masks for other ``algorithm.micro_batch_size`` values (so the same run would not
give the same result). RL trainers turn it off for that reason (TRL's ``disable_dropout_in_model``, verl's
actor configs). Most small chat models have none (Llama, Qwen2, SmolLM2 ship ``attention_dropout=0``); GPT-2
style models keep 0.1 in several places.

:func:`disable_dropout` zeroes ``p`` of every ``torch.nn`` dropout module and the float ``*dropout*``
attributes attention modules read in training mode (transformers' Llama-family ``attention_dropout``). Some
models read the probability from their config at every forward instead (transformers' Falcon:
``self.config.attention_dropout if self.training``, BLT, ...): :func:`disable_config_dropout` zeroes those
config fields in memory and returns their values, which :func:`config_as_loaded` puts back while a model is
saved (a saved model keeps its own settings). Both are applied before LoRA is added, so ``lora.dropout`` (the
adapters' own, an explicit choice) still applies.
"""

from __future__ import annotations

import contextlib

import torch

_DROPOUT_MODULES = (torch.nn.modules.dropout._DropoutNd,)


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout probability in ``model`` to 0; returns the names of those that were not 0 already
    (``"layer.attn_dropout"`` for a module, ``"layer.attention_dropout=0.1"`` for an attribute)."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, _DROPOUT_MODULES):
            if module.p:
                changed.append(name)
                module.p = 0.0
            continue
        for attr, value in vars(module).items():
            if "dropout" in attr and isinstance(value, float) and value:
                changed.append(f"{name}.{attr}={value:g}" if name else f"{attr}={value:g}")
                setattr(module, attr, 0.0)
    return changed


def _configs(config) -> list[tuple[str, object]]:
    """``config`` and its sub-configs (``text_config``, ...), with the prefix their fields are named under."""
    found = [("config", config)]
    for name in getattr(config, "sub_configs", None) or ():
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            found.append((f"config.{name}", sub))
    return found


def _is_dropout_field(name: str, value) -> bool:
    return ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float) and not isinstance(value, bool)


def disable_config_dropout(model: torch.nn.Module) -> dict[str, float]:
    """Set the non-zero float dropout fields (``*dropout*``, ``*pdrop``) of ``model.config`` and its sub-configs to 0;
    returns the old values by name (``"config.attention_dropout"``), for :func:`config_as_loaded`."""
    old = {}
    for prefix, config in _configs(getattr(model, "config", None)) if getattr(model, "config", None) is not None else ():
        for field, value in vars(config).items():
            if _is_dropout_field(field, value) and value:
                old[f"{prefix}.{field}"] = value
                setattr(config, field, 0.0)
    return old


@contextlib.contextmanager
def config_as_loaded(model: torch.nn.Module, old: dict[str, float]):
    """Within the block, the config fields :func:`disable_config_dropout` zeroed hold their loaded values again (for
    ``save_pretrained``); zeroed again on exit."""
    configs = dict(_configs(model.config)) if old else {}
    targets = [(configs[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], value) for name, value in old.items()
               if name.rsplit(".", 1)[0] in configs]
    for config, field, value in targets:
        setattr(config, field, value)
    try:
        yield
    finally:
        for config, field, _ in targets:
            setattr(config, field, 0.0)
