"""LoRA adapters through peft (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")."""

from __future__ import annotations

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
    return get_peft_model(model, config)


def base_model(model):
    """The transformers model inside a peft wrapper (``PeftModel.get_base_model()``), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
