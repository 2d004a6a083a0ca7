"""Reading a run config's layers: YAML files and ``key=value`` overrides, with errors that name the key, and the
path and model-name helpers loading needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ragen.errors import ConfigError


#: What ``trainer.gradient_checkpointing`` may say (YAML's true/false arrive as the strings "True"/"False").
CHECKPOINTING_SETTINGS = {"auto": "auto", "true": "true", "false": "false", "on": "true", "off": "false"}


def checkpointing_setting(value: Any, key: str) -> str:
    """``auto``, ``true`` or ``false`` for a ``gradient_checkpointing`` value; :class:`ConfigError` naming ``key``."""
    setting = CHECKPOINTING_SETTINGS.get(str(value).strip().lower())
    if setting is None:
        raise ConfigError(f"config key {key!r}: must be auto, true or false (got {value!r})")
    return setting


def _friendly(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
    msg = str(exc).splitlines()[0]
    if key and "is not a ListConfig, TupleConfig, list, or tuple" in msg:  # OmegaConf's words for a scalar given
        msg = f"expects a list, written [...] ({key}=[...] on the command line; got one value)"
    elif key and msg.startswith("Incompatible value 'None' for field of type 'str'"):  # `key=` reads as null
        msg = f"expects text (for an empty one write {key}='')"
    return f"config key {key!r}: {msg}" if key else msg


def load_yaml_mapping(path: str | Path) -> DictConfig:
    """A YAML file whose top level is a mapping; :class:`ConfigError` naming the file otherwise (a syntax
    error, bytes that are not UTF-8 text, a list or a scalar at the top, an unreadable file)."""
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"config file {path}:{line} is not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text") from None
    except OSError as exc:  # OmegaConf also raises it for a scalar at the top level
        if "Invalid loaded object type" in str(exc):
            raise ConfigError(f"config file {path}: the top level must be a mapping of sections") from None
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections (got a list)")
    return loaded


def overrides_layer(overrides: list[str] | tuple[str, ...]) -> DictConfig:
    """``key=value`` overrides as one config layer; :class:`ConfigError` naming the override whose value is not YAML."""
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except yaml.YAMLError:
        bad = next((item for item in overrides if _bad_yaml_value(item)), None)
        raise ConfigError(f"override {bad!r}: its value is not valid YAML" if bad else "an override's value is not valid YAML") from None
    except (ValueError, TypeError, OmegaConfBaseException):  # e.g. es.val=[...] then es.val.tag=x: a list has no key 'tag'
        layer = OmegaConf.create()
        for item in overrides:  # the first override that cannot go on top of the ones before it
            try:
                layer = OmegaConf.merge(layer, OmegaConf.from_dotlist([item]))
            except (ValueError, TypeError, OmegaConfBaseException):
                raise ConfigError(f"override {item!r} does not fit the overrides before it (a key into a list, "
                                  "or a list where they made a mapping)") from None
        raise


def _merge_fails(schema: DictConfig, *layers: DictConfig) -> bool:
    try:
        OmegaConf.to_object(OmegaConf.merge(schema, *layers))
        return False
    except (TypeError, OmegaConfBaseException):
        return True


def _culprit_override(schema: DictConfig, files: list[DictConfig], overrides: list[str] | tuple[str, ...]) -> str | None:
    """The first ``key=value`` override that fails to merge on top of the schema and the file layers, each on its own;
    None when the file layers fail without any override (the file's fault) or no single override fails."""
    if _merge_fails(schema, *files):
        return None
    return next((item for item in overrides if _merge_fails(schema, *files, OmegaConf.from_dotlist([item]))), None)


def _wrong_container(schema: DictConfig, files: list[DictConfig], overrides: list[str] | tuple[str, ...],
                     preset: str | None) -> str:
    """The message for a list where the schema has a mapping (or the reverse): the override that does it, else the file."""
    culprit = _culprit_override(schema, files, overrides)
    if culprit:
        return f"override {culprit!r}: a list where the config has a mapping, or a mapping where it has a list"
    if preset and files:
        return f"config file {preset}: a list where the config has a mapping, or a mapping where it has a list"
    return "an override puts a list where the config has a mapping, or a mapping where it has a list"


def _bad_yaml_value(item: str) -> bool:
    try:
        yaml.safe_load(item.split("=", 1)[1])
        return False
    except yaml.YAMLError:
        return True


def run_kind(path: str | Path) -> str | None:
    """``"sft"`` or ``"rl"`` for a run's config.yaml at ``path`` (``ragen sft train``'s has ``data`` and none of
    ``env``/``es``/``rollout``; ``ragen train``'s the reverse), else None: the commands name a mix-up instead of
    failing on a key the other kind has."""
    try:
        saved = yaml.safe_load(Path(path).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(saved, dict):
        return None
    sft, rl = "data" in saved, bool({"env", "es", "rollout"} & set(saved))
    return "sft" if sft and not rl else "rl" if rl and not sft else None


def builtin_model_names() -> tuple[str, ...]:
    from ragen.models.loading import BUILTIN_MODELS

    return BUILTIN_MODELS


def absolute_path(path: str, keep: tuple[str, ...] = ()) -> str:
    """An existing ``path`` made absolute (``~`` expanded; ``..`` and symlinks left as they are) as a run records it,
    so its config.yaml, a LoRA adapter's base and a resumed run name the same file from any working directory.

    ``""``, the names in ``keep`` (built-in models) and paths that do not exist are returned as typed: the error
    that follows names what the user wrote."""
    if not path or path in keep:
        return path
    full = Path(path).expanduser()
    return str(full.absolute()) if full.exists() else path
