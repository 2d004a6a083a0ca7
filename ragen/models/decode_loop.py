"""ragen's own sampling loop: ``generate``'s decode steps for the common case, without its per-step bookkeeping.

After the prompt is prefilled, transformers' ``generate`` runs, at every step: ``prepare_inputs_for_generation``
(slicing and cloning the inputs), the forward, a fresh fp32 copy of the ``(B, V)`` logits, the logits
processors, an ``argmax`` over the processed scores, ``torch.cat`` of the ids and of the attention mask, and
its stopping criteria. On a 2-core CPU that is several milliseconds a step at batch 32-64 next to a
~35-65 ms decode step. :func:`decode` computes the same tokens with less: the ids and the mask are
preallocated ``(B, W + N)`` buffers written in place, the logits are cast into one reused fp32 buffer,
and :meth:`~ragen.models.sampling.InverseCDFSampler.draw` returns the sampled token itself (no -inf scores
and ``argmax`` to recover it).

What is kept exactly as ``generate`` does it (``_sample`` in transformers 5):

- positions: ``cumsum(mask) - 1`` at the last prompt column, then one more per step;
- a finished row keeps being fed, with the pad token, and the mask grows for every row;
- a row finishes on an EOS token (``EosTokenCriteria``) or a completed stop string (transformers' own
  ``StopStringCriteria``, on the generated columns: :class:`GeneratedStopStrings`); the loop ends when every row has
  finished or after ``max_new_tokens`` steps;
- the sampler sees the ids so far (for ``min_new_tokens``) and the fp32 logits, and draws one uniform per
  row per step, so a seeded call samples the tokens ``generate`` samples (``tests/models/test_decode_loop.py``).

Only greedy decoding and :class:`~ragen.models.sampling.InverseCDFSampler` are taken here, and only when the
model's own ``generation_config`` asks for nothing more (:func:`unsupported_setting`: no repetition penalty, banned
words, beam search, ...); ``HFBackend`` hands every other request (``torch.multinomial`` sampling, such settings)
to ``generate``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StopStringCriteria

from ragen.models.cache_names import with_cache
from ragen.models.sampling import InverseCDFSampler


#: ``generation_config`` fields with which ``generate`` would do more than this loop does (logits processors such as a
#: repetition penalty, other search modes), each with the values that change nothing.
NEUTRAL_SETTINGS = {
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "sequence_bias": (None,),
    "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "min_length": (None, 0), "min_new_tokens": (None, 0),
    "exponential_decay_length_penalty": (None,), "renormalize_logits": (None, False), "guidance_scale": (None, 1, 1.0),
    "watermarking_config": (None,), "remove_invalid_values": (None, False), "num_beams": (None, 1),
    "num_beam_groups": (None, 1), "diversity_penalty": (None, 0, 0.0), "penalty_alpha": (None,),
    "prompt_lookup_num_tokens": (None,), "assistant_early_exit": (None,), "token_healing": (None, False),
    "dola_layers": (None,),
}


def unsupported_setting(generation_config) -> str | None:
    """The first ``generation_config`` field (the model's defaults, which ``generate`` merges into every call) that
    would make ``generate`` compute other tokens than :func:`decode`, or None."""
    for name, neutral in NEUTRAL_SETTINGS.items():
        value = getattr(generation_config, name, None)
        if not any(value is v or (v is not None and value == v) for v in neutral):
            return f"{name}={value!r}"
    return None



#: Each live tokenizer's built ``StopStringCriteria``, by ``(len(tokenizer), stop strings)``.
_STOP_CRITERIA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stop_string_criteria(tokenizer, stop_strings) -> StopStringCriteria:
    """transformers' ``StopStringCriteria`` for ``tokenizer`` and ``stop_strings``, built once per tokenizer.

    Building one reads the whole vocabulary and sorts it before transformers' own embedding cache is even
    consulted: ~0.12 s for SmolLM2's 49,152 tokens on 2 CPU cores, on every ``generate`` call (a multi-turn
    rollout makes one per turn and wave). The criterion keeps nothing between calls (it reads the ids it is
    given), so one serves them all. A tokenizer that gains tokens (``add_tokens``) changes ``len`` and gets
    a new one."""
    stops = tuple(stop_strings)
    built = _STOP_CRITERIA.setdefault(tokenizer, {})
    key = (len(tokenizer), stops)
    if key not in built:
        built[key] = StopStringCriteria(tokenizer, list(stops))
    return built[key]


class GeneratedStopStrings(StoppingCriteria):
    """transformers' ``StopStringCriteria`` on the generated columns only (those after ``prompt_width``).

    Given ``stop_strings``, ``generate`` checks the whole sequence, prompt included: a prompt that ends inside a stop
    string (a prefilled ``"</"``, a stop of ``"\\n\\n"``) ended a row at its first token, which the backend's cut, reading
    the generated ids alone, then reported as a length or a pad-token "EOS" the model never sampled. A stop string
    counts only within what the model wrote, as vLLM matches it."""

    def __init__(self, tokenizer, stop_strings, prompt_width: int):
        self.inner = stop_string_criteria(tokenizer, stop_strings)
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return self.inner(input_ids[:, self.prompt_width :], scores, **kwargs)  # (B,) bool

@dataclass
class DecodeOutput:
    #: ``(B, W + n)``: the prompt ids and the ``n`` steps' tokens (the pad token after a row finished).
    sequences: torch.Tensor
    #: The KV cache, holding every column but the last sampled token's.
    cache: object


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, *, max_new_tokens: int,
           eos_ids: list[int], pad_id: int, sampler: InverseCDFSampler | None = None, stop_strings=(),
           tokenizer=None, min_new_tokens: int = 0, first_logits: torch.Tensor | None = None) -> DecodeOutput:
    """Sample up to ``max_new_tokens`` tokens per row after a prefill; ``generate``'s result, computed directly.

    ``input_ids``/``attention_mask`` are ``(B, W)`` (padding 0 in the mask, anywhere); ``cache`` holds the keys
    and values of columns ``[0, W-1)``: the last prompt column is fed by the first step. ``sampler`` None is
    greedy decoding; then EOS cannot be chosen before ``min_new_tokens`` tokens (a sampler applies its own
    ``min_new_tokens``). ``stop_strings`` need the ``tokenizer``.

    With ``first_logits`` ``(B, V)`` (the prefill ran the last prompt column too: ``cache`` holds ``[0, W)``) the
    first token is sampled from them and the first model call feeds it: one forward pass fewer, the same steps after.
    """
    B, W = input_ids.shape
    device = input_ids.device
    ids = torch.full((B, W + max_new_tokens), pad_id, dtype=input_ids.dtype, device=device)  # (B, W + N)
    ids[:, :W] = input_ids
    mask = torch.ones((B, W + max_new_tokens), dtype=attention_mask.dtype, device=device)  # (B, W + N)
    mask[:, :W] = attention_mask
    positions = (attention_mask.long().sum(1, keepdim=True) - 1).clamp(min=0)  # (B, 1): the last column's position
    eos = torch.tensor(sorted(eos_ids), device=device)
    stop = GeneratedStopStrings(tokenizer, stop_strings, W) if stop_strings else None
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    logits_fp32 = None  # (B, V), reused every step
    n = 0
    for step in range(max_new_tokens):
        width = W + step
        if step == 0 and first_logits is not None:
            logits = first_logits  # (B, V): the prefill's, at the last prompt column
        else:
            out = model(input_ids=ids[:, width - 1 : width], attention_mask=mask[:, :width], position_ids=positions,
                        use_cache=True, **with_cache(cache))
            logits = out.logits[:, -1]  # (B, V) in the model's compute dtype
            del out
        if logits_fp32 is None:
            logits_fp32 = torch.empty(logits.shape, dtype=torch.float32, device=device)
        logits_fp32.copy_(logits)  # generate's fp32 copy of the logits, into one buffer
        del logits
        if sampler is None:
            if step < min_new_tokens:
                logits_fp32[:, eos] = float("-inf")  # as transformers' MinNewTokensLengthLogitsProcessor
            token = logits_fp32.argmax(-1)  # (B,)
        else:
            token = sampler.draw(ids[:, :width], logits_fp32).squeeze(1)  # (B,)
        token = torch.where(unfinished, token, pad_id)
        ids[:, width] = token
        n = step + 1
        done = torch.isin(token, eos)
        if stop is not None:
            done |= stop(ids[:, : width + 1], None)  # the new columns only (GeneratedStopStrings)
        unfinished &= ~done
        if not bool(unfinished.any()):
            break
        positions = positions + 1
    return DecodeOutput(sequences=ids[:, : W + n], cache=cache)
