"""LoRA adapters through peft (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")."""

from __future__ import annotations

import contextlib
import warnings

from peft import LoraConfig, get_peft_model

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


#: ``lora.target_modules: [all-linear]``: every linear layer but the output head (peft's own shorthand).
ALL_LINEAR = "all-linear"


def lora_targets(model, target_modules: list[str] | None) -> list[str] | str:
    """What peft adapts: the given module names; ``all-linear`` when asked for, and also when the default (Llama-family
    projection names) matches no module of ``model`` (GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value``, ...)."""
    targets = list(target_modules or DEFAULT_TARGETS)
    if targets == [ALL_LINEAR]:
        return ALL_LINEAR
    if targets == DEFAULT_TARGETS and not any(name.rsplit(".", 1)[-1] in targets for name, _ in model.named_modules()):
        return ALL_LINEAR
    return targets


def apply_lora(model, rank: int, alpha: float, dropout: float = 0.0, target_modules: list[str] | None = None):
    """Wrap ``model`` with trainable rank-``rank`` adapters; base weights are frozen."""
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=lora_targets(model, target_modules),
        task_type="CAUSAL_LM",
    )
    with peft_quietly():
        return get_peft_model(model, config)


@contextlib.contextmanager
def peft_quietly():
    """Silence one FutureWarning peft triggers inside its own ``PeftModel.__init__`` (it reads transformers 5's
    deprecated ``is_gradient_checkpointing``): the user cannot act on it. Every other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def base_model(model):
    """The transformers model inside a peft wrapper (``PeftModel.get_base_model()``), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
