"""Dropout off in the policy for RL updates (``algorithm.disable_dropout``, on by default).

PPO's ratio ``π_θ(a|s) / π_old(a|s)`` and the KL terms compare the policy with itself: ``π_old`` is scored
in eval mode (no dropout) before the update, and the update's forward runs in training mode. With dropout
on, the first step's ratio is not 1 and its clipping fires on dropout noise, and gradient accumulation over
micro-batches draws other masks for other ``algorithm.micro_batch_size`` values (so the same run would not
give the same result). RL trainers turn it off for that reason (TRL's ``disable_dropout_in_model``, verl's
actor configs). Most small chat models have none (Llama, Qwen2, SmolLM2 ship ``attention_dropout=0``); GPT-2
style models keep 0.1 in several places.

:func:`disable_dropout` zeroes ``p`` of every ``torch.nn`` dropout module and the float ``*dropout*``
attributes attention modules read in training mode (transformers' Llama-family ``attention_dropout``). It
leaves the model's ``config`` alone (a saved model keeps its own settings) and is applied before LoRA is
added, so ``lora.dropout`` (the adapters' own, an explicit choice) still applies.
"""

from __future__ import annotations

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
