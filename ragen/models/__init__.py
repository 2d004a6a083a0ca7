"""Models: loading (embedded default, tiny test model, any HF dir), LoRA, and generation backends."""

from ragen.engines.base import Generation, SamplingParams  # the engine interface's types (ragen/engines/base.py)
from ragen.models.backend import HFBackend, autocast
from ragen.models.loading import BUILTIN_MODELS, ModelLoadError, load_model
from ragen.models.lora import apply_lora

__all__ = ["Generation", "HFBackend", "SamplingParams", "autocast", "BUILTIN_MODELS", "ModelLoadError", "load_model", "apply_lora"]
