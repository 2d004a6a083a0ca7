"""One place that builds a generation engine from a run's config: the trainer, the Ray rollout workers and
``ragen eval`` all call :func:`build_engine`, and it says once which engine runs and why."""

from __future__ import annotations

from typing import Callable

from ragen.engines.base import GenerationEngine

#: Engines ``rollout.engine`` may name (``openai`` is chosen by an ``openai:NAME`` model spec in ``ragen eval``).
ENGINES = ("hf", "vllm")


def describe_hf(model, config) -> str:
    """Which path the ``hf`` engine takes on ``model`` and why: the CPU fast path or transformers' plain ``generate``."""
    r = config.rollout
    if not r.fast_decode:
        return "hf: transformers generate (rollout.fast_decode=false)"
    from ragen.models.fused_decode import unsupported_reason

    reason = unsupported_reason(model)
    if reason is not None:
        return f"hf: transformers generate with ragen's KV cache and sampling loop (the fused decode step does not take " \
               f"this model: {reason})"
    native = "on" if r.native_decode else "off (rollout.native_decode=false)"
    return f"hf: the CPU fast path (fused {getattr(model.config, 'model_type', '?')} decode step; C++ kernels {native})"


def build_engine(model, tokenizer, config, *, say: Callable[[str], None] | None = None) -> GenerationEngine:
    """The engine ``config.rollout.engine`` names, generating with ``model`` (shared with the trainer for ``hf``;
    vLLM loads its own copy and takes weight syncs)."""
    engine = config.rollout.engine
    if engine == "vllm":
        from ragen.models.vllm_backend import VLLMBackend

        built = VLLMBackend(model, tokenizer, precision=config.trainer.precision, seed=config.seed)
        why = "vllm: rollout.engine=vllm"
    elif engine == "hf":
        from ragen.models.backend import HFBackend

        built = HFBackend.from_config(model, tokenizer, config)
        why = describe_hf(model, config)
    else:
        raise ValueError(f"rollout.engine must be one of {list(ENGINES)}, got {engine!r}")
    if say is not None:
        say(f"[ragen] generation engine: {why}")
    return built
