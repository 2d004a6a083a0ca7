"""The typed run configuration: one schema, validated at construction, YAML presets on top.

``load_config(preset_or_yaml, overrides)`` merges, in order: the schema's defaults, a preset
(``ragen/configs/<name>.yaml``) or a YAML file, then ``key=value`` overrides. An unknown key or
a value of the wrong type raises :class:`ConfigError` naming the key; the CLI turns it into
one line on stderr and exit code 2.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ragen.errors import ConfigError
from ragen.models.precision import resolve_precision
from ragen.config_checks import (CONTEXT_MODES, _reject_overrides_es_train_ignores, lost_env_settings,
                                 reject_env_overrides_eval_ignores, single_env_key, user_tag_dicts, validate,
                                 validate_env_sets)
from ragen.config_files import (RESUME_SAFE_KEYS, RUN_CONFIG_HEADER, flat_config, result_changing_differences,
                                resume_safe, taken_run_entries, to_yaml, written_by_ragen)
from ragen.config_io import (CHECKPOINTING_SETTINGS, _culprit_override, _friendly, _merge_fails, _wrong_container,
                             absolute_path, builtin_model_names, checkpointing_setting, load_yaml_mapping,
                             overrides_layer, run_kind)
from ragen.config_schema import (PRESET_DIR, AdamWConfig, AgentConfig, AlgorithmConfig, EnvConfig, EnvSetsConfig,
                                 EnvTagConfig, LoraConfig, OptimConfig, RolloutConfig, RunConfig, TrainerConfig,
                                 TrainTagConfig, ValTagConfig)

#: The config API: the schema (``ragen/config_schema.py``), loading (``config_io.py``), checks (``config_checks.py``)
#: and a run's config files (``config_files.py``), importable from here.
__all__ = [
    "load_config", "ConfigError", "PRESET_DIR", "AdamWConfig", "AgentConfig", "AlgorithmConfig", "EnvConfig",
    "EnvSetsConfig", "EnvTagConfig", "LoraConfig", "OptimConfig", "RolloutConfig", "RunConfig", "TrainerConfig",
    "TrainTagConfig", "ValTagConfig", "CHECKPOINTING_SETTINGS", "absolute_path", "builtin_model_names",
    "checkpointing_setting", "load_yaml_mapping", "overrides_layer", "run_kind", "CONTEXT_MODES",
    "lost_env_settings", "reject_env_overrides_eval_ignores", "single_env_key", "user_tag_dicts", "validate",
    "validate_env_sets", "RESUME_SAFE_KEYS", "RUN_CONFIG_HEADER", "flat_config", "result_changing_differences",
    "resume_safe", "taken_run_entries", "to_yaml", "written_by_ragen", "_friendly", "_wrong_container",
]

def load_config(preset: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults ← preset name or YAML path ← ``key=value`` overrides, validated; returns a ``RunConfig``."""
    schema = OmegaConf.structured(RunConfig)
    layers: list[DictConfig] = []
    if preset:
        path = Path(preset)
        if not path.suffix:
            path = PRESET_DIR / f"{preset}.yaml"
        if path.is_file():
            layers.append(load_yaml_mapping(path))
        elif preset.endswith((".yaml", ".yml")):
            raise ConfigError(f"config file not found: {preset}")
        else:  # an env name without a preset: defaults with that env
            import ragen.envs

            if preset not in ragen.envs.registered():
                presets = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
                raise ConfigError(f"{preset!r} is neither a preset ({', '.join(presets)}), a YAML file nor an env "
                                  f"({', '.join(sorted(ragen.envs.registered()))})")
            layers.append(OmegaConf.create({"env": {"name": preset}}))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
    files = list(layers)  # the preset or YAML file (for error messages)
    try:
        layers.append(overrides_layer(overrides))
        merged = OmegaConf.merge(schema, *layers)
        config: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        message = _friendly(exc)
        culprit = _culprit_override(schema, files, overrides)
        if culprit and not message.startswith(f"config key '{culprit.split('=', 1)[0].strip()}"):
            message = f"override {culprit!r}: {message}"  # e.g. a field inside a list item, named without its path
        elif culprit is None and preset and Path(preset).suffix and _merge_fails(schema, *files):
            message = f"config file {preset}: {message}"
        raise ConfigError(message) from None
    except TypeError:  # OmegaConf cannot merge a list into a mapping section (or the other way round)
        raise ConfigError(_wrong_container(schema, files, overrides, preset)) from None
    _reject_overrides_es_train_ignores(config, overrides)
    config.model = absolute_path(config.model, keep=builtin_model_names())
    validate(config)
    config.trainer.precision = resolve_precision(config.trainer.precision, config.trainer.device)
    return config
