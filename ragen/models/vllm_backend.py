"""A vLLM generation backend (``rollout.engine=vllm``; GPU only, ``pip install 'ragen[vllm]'``).

Same interface as :class:`ragen.models.backend.HFBackend`: ``generate(token-id prompts,
SamplingParams) -> [Generation]`` and ``pad_id``, plus ``sync_weights`` so the trainer can
push each update's weights into the engine. ``vllm`` is imported only when the backend is
built; without it, or without a CUDA GPU, :func:`require_vllm` raises a clear
:class:`VLLMUnavailableError` (a ``ConfigError``: ``ragen train`` prints it and exits 2).

The request/response conversion is kept in pure functions that need neither vLLM nor a
GPU (:func:`to_vllm_sampling_kwargs`, :func:`to_generation`, :func:`weight_chunks`), so the
conventions below are unit-tested on any machine:

* **Prompts** go in as ``TokensPrompt(prompt_token_ids=...)``: the exact ids, never text.
* **Sampling**: ``do_sample=False`` is greedy (``temperature=0``); ragen's ``top_k=0`` (off,
  as in HF) is vLLM's ``-1``; ``max_new_tokens`` is ``max_tokens``; one sample per request.
  No per-request seed (a group's envs share a prompt, and equal seeds would give equal
  samples): the engine is seeded once (``LLM(seed=...)``).
* **EOS**: the backend's EOS set is HFBackend's (the model's ``generation_config`` EOS ids,
  else the tokenizer's) and is passed as ``stop_token_ids``; the EOS token is kept in
  ``token_ids`` and the reason is ``"eos"``.
* **Stop strings**: vLLM matches them on the detokenised text (with special tokens kept,
  like HFBackend's ``tokenizer.decode``) and stops at the token that completes one. It
  trims only the *text*; ``token_ids`` still end with that token, which is exactly where
  HFBackend cuts (the shortest prefix whose decoding contains the stop string), so the
  ids are passed through and the reason is ``"stop"``. ``include_stop_str_in_output=True``
  keeps vLLM's text equal to the decoded ids (ragen keeps ``</answer>`` in the response).
* **Length**: ``"length"``, unless the last allowed token was an EOS (HFBackend says
  ``"eos"`` then, and so does this backend, whatever order vLLM checks the two in).

Weight sync uses vLLM's documented RLHF hook (``examples/offline_inference/rlhf*.py``):
the engine is built with ``worker_extension_cls`` naming :class:`VLLMWorkerExtension`,
and ``LLM.collective_rpc("ragen_load_weights", args=(chunk,))`` runs
``model_runner.model.load_weights(chunk)`` in every worker; then the prefix cache (KV
blocks computed with the old weights) is reset.

None of the GPU path has run here: this was written on a CPU-only machine without vLLM.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ragen.config import ConfigError
from ragen.engines.base import Generation, SamplingParams

INSTALL_HINT = "pip install 'ragen[vllm]'"
#: ``worker_extension_cls`` for vLLM: its workers import this module and mix the class in.
WORKER_EXTENSION = f"{__name__}.VLLMWorkerExtension"
#: ragen precision -> vLLM ``dtype``.
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "auto": "auto"}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class VLLMUnavailableError(ConfigError):
    """``rollout.engine=vllm`` cannot run here (no vLLM installed, or no CUDA GPU)."""


class VLLMBackendError(RuntimeError):
    """vLLM returned something the backend cannot turn into a ragen Generation."""


# -- availability -----------------------------------------------------------------------


def require_vllm() -> Any:
    """Import and return ``vllm``; raise :class:`VLLMUnavailableError` if it or a CUDA GPU is missing."""
    problems = []
    vllm = None
    try:
        import vllm  # noqa: F811  (the optional extra)
    except ImportError as exc:
        problems.append(f"vLLM is not installed ({exc}); install it with {INSTALL_HINT}")
    if not torch.cuda.is_available():
        problems.append("vLLM needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False)")
    if problems:
        raise VLLMUnavailableError(
            "rollout.engine=vllm: " + "; ".join(problems) + ". Use rollout.engine=auto (the default) on this machine."
        )
    return vllm


def check_vllm_run(config) -> None:
    """Fail fast, before a model loads, on a run config that ``rollout.engine=vllm`` cannot serve."""
    if config.lora.rank > 0:
        raise ConfigError("rollout.engine=vllm: LoRA (lora.rank > 0) is not supported yet (weight sync sends full weights); "
                          "use rollout.engine=auto or lora.rank=0")
    if config.rollout.backend != "local":
        raise ConfigError(f"rollout.engine=vllm works with rollout.backend=local only (got {config.rollout.backend!r})")
    require_vllm()


# -- pure conversion (no vLLM, no GPU) ------------------------------------------------------


def to_vllm_sampling_kwargs(params: SamplingParams, eos_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one ragen request (see the module docstring)."""
    kwargs: dict[str, Any] = dict(
        n=1,
        max_tokens=int(params.max_new_tokens),
        stop=list(params.stop),
        stop_token_ids=sorted({int(t) for t in eos_ids}),
        include_stop_str_in_output=True,
        skip_special_tokens=False,  # stop strings are matched on the text HFBackend's decode() sees
        detokenize=True,  # stop strings need the text
    )
    if params.do_sample:
        kwargs.update(temperature=float(params.temperature), top_p=float(params.top_p),
                      top_k=int(params.top_k) if params.top_k > 0 else -1)
    else:
        kwargs.update(temperature=0.0, top_p=1.0, top_k=-1)
    if params.min_new_tokens:
        kwargs.update(min_tokens=int(params.min_new_tokens))
    return kwargs


def to_generation(output: Any, eos_ids: Iterable[int]) -> Generation:
    """A vLLM ``RequestOutput`` (or its ``CompletionOutput``) -> ``Generation`` with HFBackend's conventions.

    Reads only ``outputs[0].token_ids``, ``.finish_reason`` (``"stop"``/``"length"``;
    anything else, e.g. ``"abort"``, is an error) and ``.stop_reason`` (the matched stop
    string, a stop token id, or None for the model's EOS).
    """
    completion = output.outputs[0] if hasattr(output, "outputs") else output
    ids = [int(t) for t in completion.token_ids]
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise VLLMBackendError(f"vLLM request ended with finish_reason={reason!r} (expected 'stop' or 'length')")
    if isinstance(getattr(completion, "stop_reason", None), str):
        return Generation(ids, "stop")  # ids end with the token that completed the stop string
    eos = set(eos_ids)
    eos_at = next((i for i, t in enumerate(ids) if t in eos), None)
    if eos_at is not None:
        return Generation(ids[: eos_at + 1], "eos")
    if reason == "stop":  # stopped on the engine's own EOS id (outside ragen's EOS set): still an EOS, kept
        return Generation(ids, "eos")
    return Generation(ids, "length")


def weight_chunks(items: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                  max_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs as detached, contiguous CPU tensors (cast to ``dtype``), in lists of <= ``max_bytes``.

    A single tensor larger than ``max_bytes`` is a chunk of its own.
    """
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in items:
        t = tensor.detach()
        t = (t.to(dtype) if dtype is not None else t).cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += nbytes
    if chunk:
        yield chunk


def _eos_ids(generation_config, tokenizer) -> set[int]:
    """HFBackend's EOS set: the generation config's EOS id(s), else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


# -- the backend ----------------------------------------------------------------------------


class VLLMWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called through ``LLM.collective_rpc``."""

    def ragen_load_weights(self, weights) -> int:
        weights = [(name, tensor) for name, tensor in weights]
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)


class VLLMBackend:
    """Sampling with a vLLM engine on the GPU; ``sync_weights`` after each update keeps it on-policy.

    ``model`` is an HF model directory, or a loaded ``transformers`` model (it is saved to a
    temporary directory for vLLM to load, so the engine starts from exactly the trainer's
    weights). Extra keyword arguments go to ``vllm.LLM`` (e.g. ``max_model_len``).
    """

    def __init__(self, model, tokenizer, *, precision: str = "bf16", gpu_memory_utilization: float = 0.5,
                 seed: int = 0, enforce_eager: bool = False, **engine_kwargs):
        vllm = require_vllm()
        self.tokenizer = tokenizer
        self.precision = precision
        self.weight_dtype = TORCH_DTYPES.get(precision)  # sync_weights casts to the engine's dtype ("auto": as is)
        if isinstance(model, (str, Path)):
            from transformers import GenerationConfig

            try:
                generation_config = GenerationConfig.from_pretrained(model)
            except OSError:
                generation_config = None
        else:
            generation_config = getattr(model, "generation_config", None)
        self.eos_ids = _eos_ids(generation_config, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))
        engine = dict(dtype=VLLM_DTYPES[precision], gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                      enforce_eager=enforce_eager, worker_extension_cls=WORKER_EXTENSION, **engine_kwargs)
        if isinstance(model, (str, Path)):
            self.llm = vllm.LLM(model=str(model), **engine)
        else:
            with tempfile.TemporaryDirectory(prefix="ragen-vllm-") as tmp:  # vLLM reads it only while starting
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                self.llm = vllm.LLM(model=tmp, **engine)
        self._vllm = vllm

    @property
    def context_limit(self) -> int | None:
        """The engine's ``max_model_len`` (prompt + answer tokens), or None if this vLLM does not expose it."""
        try:
            return int(self.llm.llm_engine.model_config.max_model_len)
        except (AttributeError, TypeError, ValueError):
            return None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        from vllm.inputs import TokensPrompt

        sampling = self._vllm.SamplingParams(**to_vllm_sampling_kwargs(params, self.eos_ids))
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)  # in request order
        return [to_generation(out, self.eos_ids) for out in outputs]

    def sync_weights(self, state_dict_items: Iterable[tuple[str, torch.Tensor]], max_bytes: int = 512 << 20) -> int:
        """Load (HF-named) weights into every vLLM worker, chunk by chunk; reset the prefix cache. Returns #tensors."""
        sent = 0
        for chunk in weight_chunks(state_dict_items, self.weight_dtype, max_bytes):
            self.llm.collective_rpc("ragen_load_weights", args=(chunk,))
            sent += len(chunk)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return sent
