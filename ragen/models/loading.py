"""Load a causal LM + tokenizer by name or path: ``smollm2-135m`` (embedded), ``tiny`` (tests), or any HF dir."""

from __future__ import annotations

from pathlib import Path

from ragen.models.embedded import EMBEDDED_NAME, embedded_model_dir
from ragen.models.tiny import TINY_NAME, load_tiny

BUILTIN_MODELS = (EMBEDDED_NAME, TINY_NAME)


class ModelLoadError(ValueError):
    """The model spec names no loadable model (clear message, no traceback at the CLI)."""


def resolve_model_path(spec: str) -> Path:
    """Map a model spec to a local HF model directory (the embedded one is converted on first use)."""
    if spec == EMBEDDED_NAME:
        return embedded_model_dir()
    path = Path(spec).expanduser()
    for candidate in (path, path / "final"):  # a ragen run dir keeps its weights in final/
        if (candidate / "config.json").is_file() or (candidate / "adapter_config.json").is_file():
            return candidate
    raise ModelLoadError(
        f"model={spec!r} is not a model: expected one of {', '.join(BUILTIN_MODELS)} or a directory "
        "with a Hugging Face config.json (or a ragen run dir with final/). Nothing is downloaded at run time."
    )


def load_model(spec: str, *, seed: int = 0):
    """Return ``(model, tokenizer)`` with fp32 master weights, in eval mode.

    A directory holding a peft adapter (``adapter_config.json``) is loaded on its base
    model and merged, so callers always get a plain transformers model.
    """
    if spec == TINY_NAME:
        model, tokenizer = load_tiny(seed=seed)
        return model.eval(), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(spec)
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer
