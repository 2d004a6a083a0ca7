"""One place that builds a generation engine from a run's config: the trainer, the Ray rollout workers and
``ragen eval`` all call :func:`build_engine`, and it says once which engine runs and why."""

from __future__ import annotations

from typing import Callable

from ragen.engines.base import ENGINES, GenerationEngine



def uses_fast_path(config) -> bool:
    """Whether the transformers engine runs with the CPU fast path: ``cpu`` always, ``hf`` never, ``auto`` as
    ``rollout.fast_decode`` says."""
    engine = config.rollout.engine
    return engine == "cpu" or (engine == "auto" and config.rollout.fast_decode)


def describe_hf(model, config) -> str:
    """Which path the transformers engine takes on ``model`` and why: ``cpu`` (the CPU fast path) or ``hf`` (plain
    ``generate``)."""
    r = config.rollout
    if not uses_fast_path(config):
        why = "rollout.engine=hf" if r.engine == "hf" else "rollout.fast_decode=false"
        return f"hf: transformers generate ({why})"
    from ragen.models.fused_decode import unsupported_reason

    reason = unsupported_reason(model)
    if reason is not None:
        return f"cpu: transformers generate with ragen's KV cache and sampling loop (the fused decode step does not " \
               f"take this model: {reason})"
    native = "on" if r.native_decode else "off (rollout.native_decode=false)"
    return f"cpu: the CPU fast path (fused {getattr(model.config, 'model_type', '?')} decode step; C++ kernels {native})"


def build_engine(model, tokenizer, config, *, say: Callable[[str], None] | None = None) -> GenerationEngine:
    """The engine ``config.rollout.engine`` names, generating with ``model`` (shared with the trainer for ``hf``,
    ``cpu`` and ``auto``; vLLM loads its own copy and takes weight syncs)."""
    engine = config.rollout.engine
    if engine == "vllm":
        from ragen.models.vllm_backend import VLLMBackend

        built = VLLMBackend(model, tokenizer, precision=config.trainer.precision, seed=config.seed)
        why = "vllm: rollout.engine=vllm"
    elif engine in ("auto", "hf", "cpu"):
        from ragen.models.backend import HFBackend

        built = HFBackend.from_config(model, tokenizer, config, fast=uses_fast_path(config))
        why = describe_hf(model, config)
    else:
        raise ValueError(f"rollout.engine must be one of {list(ENGINES)}, got {engine!r}")
    if say is not None:
        say(f"[ragen] generation engine: {why}")
    return built
