"""LoRA adapters through peft (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")."""

from __future__ import annotations

import contextlib
import warnings

from peft import LoraConfig, get_peft_model

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def apply_lora(model, rank: int, alpha: float, dropout: float = 0.0, target_modules: list[str] | None = None):
    """Wrap ``model`` with trainable rank-``rank`` adapters; base weights are frozen."""
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules or DEFAULT_TARGETS),
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
