"""Generation backends: ``generate(token-id prompts, sampling params) -> sampled token ids``.

The agent layer talks only to this interface, so the HF backend here can be swapped for
vLLM or Ray rollout workers without touching the rollout. Every backend returns exactly
the ids it sampled (never re-tokenised text), cut right after the first EOS or the
first completed stop string, with the reason it stopped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ragen.models.precision import resolve_precision


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    #: Generation ends once any of these strings is complete (e.g. ``"</answer>"``).
    stop: tuple[str, ...] = field(default_factory=tuple)


@dataclass
class Generation:
    token_ids: list[int]
    #: "eos" (sampled an EOS token; it is included), "stop" (completed a stop string), or "length".
    finish_reason: str


def autocast(precision: str):
    """bf16 autocast on CPU (fp32 master weights, bf16 matmuls), a no-op for fp32; "auto" per ``resolve_precision``."""
    precision = resolve_precision(precision)
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")


class HFBackend:
    """Batched sampling with ``transformers``' ``generate`` on left-padded prompts."""

    def __init__(self, model, tokenizer, *, precision: str = "bf16", batch_size: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.precision = precision
        self.batch_size = batch_size
        eos = model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out: list[Generation] = []
        for start in range(0, len(prompts), self.batch_size):
            out.extend(self._generate_batch(prompts[start : start + self.batch_size], params))
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, P) left-padded
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        kwargs = dict(
            max_new_tokens=params.max_new_tokens,
            do_sample=params.do_sample,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
        )
        if params.do_sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
        if params.stop:
            kwargs.update(stop_strings=list(params.stop), tokenizer=self.tokenizer)
        was_training = self.model.training
        self.model.eval()
        try:
            with autocast(self.precision):
                cache = self._shared_prefill(prompts, input_ids, attention_mask)
                if cache is not None:
                    kwargs["past_key_values"] = cache
                sequences = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        finally:
            self.model.train(was_training)
        new_tokens = sequences[:, width:].tolist()  # (B, N)
        return [self._cut(ids, params) for ids in new_tokens]

    def _shared_prefill(self, prompts: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """KV cache of all but the last prompt column, computed once per distinct prompt and copied per row.

        A group's envs share a seed and so, at turn 1, the whole prompt: prefilling ``B`` rows
        that hold only ``U`` distinct prompts costs ``U`` prompt passes instead of ``B``. Returns
        None when every prompt is distinct (or the model has no KV cache), and ``generate``
        prefills as usual. The last column stays uncached because ``generate`` needs at least
        one new token to start from; the cache covers columns ``[0, P-1)`` of the same
        left-padded layout, with the positions ``generate`` itself would use.
        """
        distinct: dict[tuple[int, ...], int] = {}
        row_prompt = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        if len(distinct) == len(prompts) or input_ids.shape[1] < 2 or not self.model.config.use_cache:
            return None
        first_row = {u: row_prompt.index(u) for u in range(len(distinct))}
        rows = torch.tensor([first_row[u] for u in range(len(distinct))])
        ids, mask = input_ids[rows, :-1], attention_mask[rows, :-1]  # (U, P-1)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.reorder_cache(torch.tensor(row_prompt))  # (U, ...) -> (B, ...)
        return cache

    def _cut(self, ids: list[int], params: SamplingParams) -> Generation:
        """Keep the tokens up to the first finish event; what HF filled in after it is padding."""
        eos_at = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
        stop_at = self._stop_end(ids if eos_at is None else ids[:eos_at], params.stop)
        if stop_at is not None:
            return Generation(ids[:stop_at], "stop")
        if eos_at is not None:
            return Generation(ids[: eos_at + 1], "eos")
        return Generation(ids, "length")

    def _stop_end(self, ids: list[int], stops: tuple[str, ...]) -> int | None:
        """Smallest n such that decode(ids[:n]) contains a stop string (binary search; containment is monotone)."""
        if not stops:
            return None
        decode = self.tokenizer.decode
        if not any(s in decode(ids) for s in stops):
            return None
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(ids[:mid]) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        return lo
