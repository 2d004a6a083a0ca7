"""The generation engine interface: what the rollout stage asks of whatever samples the policy's answers.

An engine turns token-id prompts into sampled token ids: ``generate(prompts, params) -> [Generation]``, exactly the
ids it sampled (never re-tokenised text), cut right after the first EOS or completed stop string, with the reason it
stopped. Engines (``rollout.engine``): ``hf`` (plain transformers ``generate``, ragen/models/backend.py: the reference),
``cpu`` (the same transformers model with ragen's CPU fast path behind it), ``auto`` (``cpu`` unless
``rollout.fast_decode`` is false), ``vllm`` (GPU, ragen/models/vllm_backend.py) and ``openai`` (a chat API, evaluation
only, ragen/models/openai_backend.py). :func:`ragen.engines.factory.build_engine` makes one from a run's config.

This module imports nothing heavy (no torch, no transformers), so ``ragen.agent`` depends on it alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterable, Protocol, runtime_checkable

#: Engines ``rollout.engine`` may name (``openai`` is chosen by an ``openai:NAME`` model spec in ``ragen eval``).
ENGINES = ("auto", "hf", "cpu", "vllm")


@dataclass
class SamplingParams:
    """One generation request. ``temperature``, ``top_k`` (0: off) and ``top_p`` (1: off) alone shape the sampled
    distribution with either HF sampler (and on the vLLM engine): the model's ``generation_config`` warpers (its
    temperature, top-k, top-p, min-p, typical-p, ...) are not applied (:mod:`ragen.models.sampling`, "Which
    distribution"). The trainer's log-probs assume ``softmax(logits / temperature)``: exact with top-k and top-p off,
    not with them on."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    #: Generation ends once any of these strings is complete (e.g. ``"</answer>"``).
    stop: tuple[str, ...] = field(default_factory=tuple)
    #: End-of-sequence tokens cannot be sampled before this many new tokens (transformers'
    #: ``min_new_tokens``; on the vLLM engine ``min_tokens``, which holds back stop strings too). On the
    #: HF engine stop strings still end a generation. Benchmarks use it for exact lengths.
    min_new_tokens: int = 0


@dataclass
class Generation:
    token_ids: list[int]
    #: "eos" (sampled an EOS token; it is included), "stop" (completed a stop string), or "length".
    finish_reason: str
    #: Per token of ``token_ids``, the log-probability the engine sampled it with (``log softmax(z / T)`` at the token
    #: with top-k and top-p off); None where the engine does not report them (greedy decoding, some engines).
    logprobs: list[float] | None = None


@runtime_checkable
class GenerationEngine(Protocol):
    """What the rollout stage needs from an engine. Optional extras, looked up with ``getattr``:

    * ``session(keep_kv: bool) -> context manager``: one rollout's scope; an engine may keep each episode's KV cache
      between its turns inside it (the HF engine does, ``rollout.reuse_kv``);
    * ``sync_weights(named_tensors)``: take the trainer's updated weights (engines holding their own copy: vLLM);
    * ``context_limit``: the most tokens (prompt + answer) the model takes;
    * ``close()``: free what the engine holds.
    """

    #: The id prompts are padded with.
    pad_id: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One generation per prompt, in order."""
        ...


def engine_session(engine: Any, keep_kv: bool) -> ContextManager:
    """``engine.session(keep_kv=...)`` where the engine has one, else a context that does nothing."""
    session = getattr(engine, "session", None)
    return session(keep_kv=keep_kv) if session is not None else contextlib.nullcontext()


def sync_engine_weights(engine: Any, named_tensors: Iterable[tuple[str, Any]]) -> bool:
    """Hand the trainer's updated weights to an engine that keeps its own copy; False if it shares the model."""
    sync = getattr(engine, "sync_weights", None)
    if sync is None:
        return False
    sync(named_tensors)
    return True
