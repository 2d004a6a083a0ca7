"""Merge a LoRA adapter into its base model: a standalone Hugging Face model directory.

``W' = W + (alpha / r) · B A`` for every adapted weight (peft's ``merge_and_unload``, Hu et
al. 2021, eq. 3), written with ``save_pretrained`` (safetensors) next to the tokenizer, so
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``
load it without ragen or peft.
"""

from __future__ import annotations

from pathlib import Path

from ragen.files import write_dir_atomic
from ragen.models.loading import ModelLoadError, adapter_base, resolve_model_path


def merge_adapter(spec: str | Path, out: str | Path) -> dict:
    """Merge the adapter at ``spec`` (an adapter dir, or a run dir whose ``final/`` is one) into ``out``.

    Returns ``{"adapter", "base", "out"}``. Raises :class:`ModelLoadError` if ``spec`` is not
    a LoRA adapter (a fully fine-tuned run is already a standalone model: use its ``final/``)
    or ``out`` already holds a model.
    """
    from ragen.models.loading import load_model

    path = resolve_model_path(str(spec))
    if not (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        raise ModelLoadError(f"{spec}: not a LoRA adapter (no adapter_config.json); a full fine-tune's {path} is already a standalone model")
    out = Path(out)
    if (out / "config.json").is_file():
        raise ModelLoadError(f"--out {out} already holds a model (config.json); choose another directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelLoadError(f"--out {out} exists and is not an empty directory; choose a new one")
    # load_model merges an adapter dir the way training saw it: a tied head / embedding is untied before an adapter
    # on either is merged, and an adapter saved without a tokenizer gets its base's
    merged, tokenizer = load_model(str(path))

    def write(directory: Path) -> None:
        merged.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)

    write_dir_atomic(out, write)  # built next to it, then swapped in: a failure leaves no half-written model
    return {"adapter": str(path), "base": adapter_base(path)[0], "out": str(out)}


__all__ = ["merge_adapter"]
