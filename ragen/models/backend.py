"""The ``hf`` generation engine: transformers models, with ragen's CPU fast path behind ``rollout.fast_decode``.

It implements :class:`ragen.engines.base.GenerationEngine`: ``generate(token-id prompts, sampling params)`` returns
exactly the ids it sampled (never re-tokenised text), cut right after the first EOS or the first completed stop
string, with the reason it stopped. Built by :func:`ragen.engines.factory.build_engine`.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import DynamicCache

from ragen.engines.base import Generation, SamplingParams
from ragen.models.cache_names import CACHE_KWARG, output_cache
from ragen.models.cast_cache import frozen_weights_cast_once
from ragen.models.decode_attention import decode_attention_for
from ragen.models.decode_loop import DecodeOutput, GeneratedStopStrings, decode, unsupported_setting
from ragen.models.device import model_device
from ragen.models.fused_decode import FusedDecoder, decoder_stack, fused_decode_for
from ragen.models.growing_cache import plain_layers
from ragen.models.precision import resolve_precision
from ragen.models.prefix_cache import CachedPrefix, PrefixKVCache
from ragen.models.prompt_prefill import PrefillStats, PromptPrefill
from ragen.models.sampling import InverseCDFSampler, multinomial_generate_kwargs
from ragen.models.transposed_gemm import transposed_linears
from ragen.runtime import return_freed_memory

if TYPE_CHECKING:
    from ragen.config import RunConfig


def autocast(precision: str, device_type: str = "cpu"):
    """bf16 autocast on ``device_type`` ("cpu" or "cuda"; fp32 master weights, bf16 matmuls), a no-op for fp32.

    "auto" resolves per :func:`~ragen.models.precision.resolve_precision` for that device type.
    """
    precision = resolve_precision(precision, device_type)
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")




class HFBackend(PromptPrefill):
    """Batched sampling with ``transformers``' ``generate`` (or ragen's own loop, below) on left-padded prompts.

    ``reuse_kv=True`` keeps each row's KV cache between calls made inside one
    :meth:`session` with ``keep_kv`` (one ``Rollout.run``): a prompt that extends an earlier
    prompt and its reply prefills only the new tokens (:mod:`ragen.models.prefix_cache`), up to
    ``reuse_kv_max_bytes`` of kept caches (None: no bound); rows beyond it prefill as usual, in
    batches of their own once the budget has refused a row in the session (a batch mixing them
    with resuming rows would run every row's new block at the width of a whole history).

    ``sampler="inverse_cdf"`` (default) draws sampled tokens with
    :class:`~ragen.models.sampling.InverseCDFSampler` (same distribution, one uniform per row);
    ``"multinomial"`` leaves sampling to ``generate(do_sample=True)``, with the model's own
    ``generation_config`` warpers switched off so that both sample what ``SamplingParams`` describes.

    ``transposed_gemm=True`` (default) computes the plain fp32 CPU ``nn.Linear`` layers (decoder
    projections and LM head) as ``(W @ hᵀ)ᵀ`` while generating, for calls of up to 128 rows
    (:mod:`ragen.models.transposed_gemm`: the same outputs up to float rounding, a faster GEMM
    layout at decoding's row counts); the model is restored after each call.

    ``grow_cache=True`` (default) gives ``generate`` a KV cache that grows in place
    (:mod:`ragen.models.growing_cache`: room for every token the call may write, no
    ``torch.cat`` of the whole cache per decode step).

    ``decode_attention=True`` (default) runs a CPU ``sdpa`` model's one-token decode attention as
    two small matmuls instead of torch's flash kernel (:mod:`ragen.models.decode_attention`: the
    same quantity with an fp32 softmax; prefill and training keep ``sdpa``). All three follow
    ``rollout.fast_decode``.

    ``fused_decode=True`` takes Llama-family decode steps through :mod:`ragen.models.fused_decode`;
    ``common_prefix=True`` prefills the distinct prompts' common first tokens once (:meth:`_common_prefill`);
    ``decode_loop=True`` samples with :func:`ragen.models.decode_loop.decode` instead of ``generate`` where it
    may (greedy or the inverse-CDF sampler, Llama-family models); ``fused_prefill=True`` runs the prompt prefill of a
    model whose decode steps are fused through the same packed weights (:mod:`ragen.models.fused_prefill`);
    ``first_from_prefill=True`` lets that prefill run the prompts' last tokens too (once per distinct prompt, or per row
    when resuming kept caches), so the decode loop samples the first token from their logits (:class:`Prefilled`)
    instead of a decode step of every row. All follow ``rollout.fast_decode``. ``native_decode=True`` runs the fused
    step's bf16 grouped-prefix steps in C++ (:mod:`ragen.models.native_decode`) and its fp32 projections' decode-sized
    calls on the C++ panel GEMM (:mod:`ragen.models.packed_linear`; ``rollout.native_decode``).

    Under bf16 autocast, frozen fp32 weights (LoRA's base model, a Ray worker's copy) are cast
    to bf16 once per ``generate`` call rather than at every decode step, as trained weights are
    (:mod:`ragen.models.cast_cache`; the same casts, made fewer times: always on).
    """

    SAMPLERS = ("inverse_cdf", "multinomial")
    #: Fewest tokens the distinct prompts of a call must share before :meth:`_common_prefill` computes them once,
    #: and fewest prefill tokens that must save (its extra one-row pass costs about as much as ~30-60 prompt
    #: tokens of prefill on a 2-core CPU: the bandit preset's 63 shared tokens of 8 prompts saved 0.14 s of 0.39).
    min_common_prefix = 8
    min_common_saved = 64

    def __init__(self, model, tokenizer, *, precision: str = "bf16", batch_size: int = 64, reuse_kv: bool = True,
                 reuse_kv_max_bytes: int | None = 4 * 2**30, sampler: str = "inverse_cdf", transposed_gemm: bool = True,
                 grow_cache: bool = True, decode_attention: bool = True, fused_decode: bool = True,
                 common_prefix: bool = True, decode_loop: bool = True, fused_prefill: bool = True,
                 first_from_prefill: bool = True, native_decode: bool = True):
        if sampler not in self.SAMPLERS:
            raise ValueError(f"sampler must be one of {self.SAMPLERS}, got {sampler!r}")
        self.sampler = sampler
        self.transposed_gemm = transposed_gemm
        self.grow_cache = grow_cache
        self.decode_attention = decode_attention
        self.fused_decode = fused_decode
        self.common_prefix = common_prefix
        self._plain_layers: bool | None = None
        self.decode_loop = decode_loop
        self.fused_prefill = fused_prefill
        #: Where ragen's decode loop runs after the fused prefill, that prefill also runs the prompts' last tokens (once per
        #: distinct prompt; per row when resuming kept caches) and the loop samples the first token from their logits:
        #: one decode step of all ``B`` rows fewer per call.
        self.first_from_prefill = first_from_prefill
        self._prefill_fused = False  # within a call: the fused decode step is switched on and fused_prefill asked for
        self.fused = FusedDecoder()  # the fused decode weights, kept for one session (one rollout)
        self.fused.native = native_decode
        self._in_session = False
        self.model = model
        self.tokenizer = tokenizer
        self.precision = precision
        self.batch_size = batch_size
        self.prefix_cache = PrefixKVCache(reuse_kv_max_bytes) if reuse_kv and model.config.use_cache else None
        self.stats = PrefillStats()
        eos = model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))

    @classmethod
    def from_config(cls, model, tokenizer, config: "RunConfig", fast: bool | None = None) -> "HFBackend":
        """The backend a run's config asks for (``trainer.precision``, ``rollout.batch_size``, ``reuse_kv``,
        ``reuse_kv_max_gb``, ``fast_decode``, ``native_decode``); :func:`ragen.engines.factory.build_engine` calls it.
        ``fast`` (None: ``rollout.fast_decode``) turns the CPU fast path's levers on or off together."""
        r = config.rollout
        fast = r.fast_decode if fast is None else fast
        return cls(model, tokenizer, precision=config.trainer.precision, batch_size=r.batch_size, reuse_kv=r.reuse_kv,
                   reuse_kv_max_bytes=None if math.isinf(r.reuse_kv_max_gb) else int(r.reuse_kv_max_gb * 2**30),
                   transposed_gemm=fast, grow_cache=fast, decode_attention=fast, fused_decode=fast,
                   common_prefix=fast, decode_loop=fast, fused_prefill=fast, first_from_prefill=fast,
                   native_decode=fast and r.native_decode)

    @contextlib.contextmanager
    def session(self, keep_kv: bool = True):
        """One rollout's generation calls: KV caches kept between turns (if ``keep_kv`` and ``reuse_kv``)."""
        kv = self.prefix_cache.session(enabled=keep_kv) if self.prefix_cache is not None else contextlib.nullcontext()
        self._in_session = True
        try:
            with kv:
                yield self
        finally:
            self._in_session = False
            self.fused.clear()  # the weights change before the next rollout
            return_freed_memory()  # the rollout's KV caches and packed weights are gone: give their pages back

    @property
    def context_limit(self) -> int | None:
        """The model's context length (``config.max_position_embeddings``), or None if it does not say."""
        return getattr(getattr(self.model, "config", None), "max_position_embeddings", None)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        keeping = self.prefix_cache is not None and self.prefix_cache.active
        kept = [self.prefix_cache.take(p) for p in prompts] if keeping else [None] * len(prompts)
        if keeping:
            # Every episode still playing is in this call, so an entry no prompt took belongs to an
            # episode that ended (or whose prompts do not extend each other): it is dead.
            self.prefix_cache.clear()
        # Once the budget has refused rows' caches in this rollout, rows resuming a cache (a few new
        # tokens) and rows without one (a whole history) are batched apart: in one batch every row
        # would run the longest new block through the model. Until then rows keep their order, so
        # the batches (and a sampled run's random draws) are those of reuse_kv=false.
        split = keeping and self.prefix_cache.refused > 0
        resuming = [i for i, k in enumerate(kept) if split and k is not None]
        rest = [i for i, k in enumerate(kept) if not (split and k is not None)]
        out: list[Generation | None] = [None] * len(prompts)
        try:
            for rows in (resuming, rest):
                for start in range(0, len(rows), self.batch_size):
                    chunk = rows[start : start + self.batch_size]
                    batch_kept = [kept[i] for i in chunk]
                    for i in chunk:
                        kept[i] = None  # the batch owns them now
                    for i, generation in zip(chunk, self._generate_batch([prompts[i] for i in chunk], params, batch_kept,
                                                                         keeping)):
                        out[i] = generation
        finally:
            if not self._in_session:
                self.fused.clear()  # the parameters may change before the next call
            if keeping:  # a turn's caches grew a little each: without a trim the freed older ones stay resident as holes
                return_freed_memory()
        return out

    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, kept: list[CachedPrefix | None], keeping: bool
    ) -> list[Generation]:
        kwargs = dict(
            max_new_tokens=params.max_new_tokens,
            do_sample=params.do_sample,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
            return_dict_in_generate=True,
        )
        sampler = None  # greedy; False: sampled with torch.multinomial, left to generate
        if params.do_sample and self.sampler == "inverse_cdf":
            # generate's greedy step takes the token the processor drew (ragen/models/sampling.py); the
            # processor also keeps EOS out until min_new_tokens (in place, no fresh (B, V) tensors)
            sampler = InverseCDFSampler(params.temperature, params.top_k, params.top_p,
                                        suppress=sorted(self.eos_ids), min_new_tokens=params.min_new_tokens)
            kwargs.update(do_sample=False, logits_processor=LogitsProcessorList([sampler]))
        else:
            if params.do_sample:
                sampler = False
                # the inverse-CDF sampler's distribution: ragen's warpers only, the model's generation_config ones off
                kwargs.update(multinomial_generate_kwargs(self.model.generation_config, params.temperature,
                                                          params.top_k, params.top_p))
            if params.min_new_tokens:
                kwargs.update(min_new_tokens=params.min_new_tokens)
        was_training = self.model.training
        self.model.eval()
        try:
            # fused_decode_for checks the model's linears before transposed_linears swaps their forwards
            self.fused.call_new_tokens = params.max_new_tokens  # whether MKL packing pays (FusedDecoder.pack_rows_if_it_pays)
            with autocast(self.precision, self.device.type), \
                    fused_decode_for(self.model, self.fused, self.fused_decode) as fused, \
                    transposed_linears(self.model, self.transposed_gemm), \
                    decode_attention_for(self.model, self.decode_attention), \
                    frozen_weights_cast_once(self.model, self.device.type):
                self._prefill_fused = fused and self.fused_prefill
                # ragen's loop can start from the prefill's logits of each row's last prompt token (the prefill runs
                # that token once per distinct prompt); generate feeds it as its first decode step itself
                looping = (self.decode_loop and sampler is not False and decoder_stack(self.model) is not None
                           and unsupported_setting(self.model.generation_config) is None)
                last = looping and self.first_from_prefill and self._prefill_fused
                start, built = time.perf_counter(), self.fused.build_s
                room = params.max_new_tokens if self.grow_cache else None  # columns generate may add to the cache
                if any(k is not None for k in kept):
                    prefilled = self._resume_prefill(prompts, kept, room, last=last)
                    if keeping:  # copied into ``cache``: free the entries (and their share of the budget) before decoding
                        self.prefix_cache.release(sum(k.nbytes for k in kept if k is not None))
                    kept.clear()
                    if fused and room is not None:
                        self._record_rows_as_groups_of_one(prefilled, room)
                elif not (self.common_prefix and (prefilled := self._common_prefill(prompts, room, share=fused, last=last))):
                    input_ids, attention_mask = self._left_pad(prompts)
                    prefilled = self._shared_prefill(prompts, input_ids, attention_mask, room, share=fused, last=last)
                input_ids, attention_mask, cache = prefilled.input_ids, prefilled.attention_mask, prefilled.cache
                if cache is not None:
                    kwargs[CACHE_KWARG] = cache
                middle, built_in_prefill = time.perf_counter(), self.fused.build_s - built
                if looping and cache is not None:
                    out = decode(self.model, input_ids, attention_mask, cache, max_new_tokens=params.max_new_tokens,
                                 eos_ids=sorted(self.eos_ids), pad_id=self.pad_id, sampler=sampler,
                                 stop_strings=params.stop, tokenizer=self.tokenizer, min_new_tokens=params.min_new_tokens,
                                 first_logits=prefilled.first_logits)
                else:
                    if params.stop:  # matched in the generated columns only
                        kwargs["stopping_criteria"] = StoppingCriteriaList(
                            [GeneratedStopStrings(self.tokenizer, params.stop, input_ids.shape[1])])
                    out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
                built_in_decode = self.fused.build_s - built - built_in_prefill
                self.stats.prefill_s += middle - start - built_in_prefill
                self.stats.decode_s += time.perf_counter() - middle - built_in_decode
                self.stats.weights_s += built_in_prefill + built_in_decode
        finally:
            self.model.train(was_training)
            self._prefill_fused = False
            self.fused.prefix = None  # describes this call's rows only
            self.fused.call_new_tokens = None
        width = input_ids.shape[1]
        generations = [self._cut(ids, params) for ids in out.sequences[:, width:].tolist()]  # (B, N)
        if sampler and sampler.drawn_logprobs:  # (N, B): step k's draw is every row's k-th new token
            drawn = torch.stack(sampler.drawn_logprobs).T.tolist()  # (B, N)
            for generation, row in zip(generations, drawn):
                generation.logprobs = row[: len(generation.token_ids)]
        if keeping:
            self._keep(out.cache if isinstance(out, DecodeOutput) else output_cache(out), prompts, attention_mask, generations)
        return generations

    @property
    def device(self) -> torch.device:
        """Where the model's weights are: prompt tensors are built on the CPU and moved there."""
        return model_device(self.model)

    def _plain_cache_layers(self) -> bool:
        """Whether the model's KV cache is made of plain ``DynamicLayer``s (asked once per backend)."""
        if self._plain_layers is None:
            self._plain_layers = plain_layers(DynamicCache(config=self.model.config))
        return self._plain_layers

    def _keep(self, cache, prompts: list[list[int]], attention_mask: torch.Tensor, generations: list[Generation]) -> None:
        """Store each row's keys and values (prompt and sampled tokens, padding dropped) for the next turn, as far
        as the budget allows (rows that do not fit are counted in ``refused``)."""
        layers = getattr(cache, "layers", None)
        if not plain_layers(cache):
            return  # sliding-window, quantized, ... caches are not re-laid out here; those rows prefill as usual
        width, cached = attention_mask.shape[1], cache.get_seq_length()
        # bytes one token's keys and values take over all layers
        token_bytes = sum(layer.keys[0, :, 0].numel() * layer.keys.element_size()
                          + layer.values[0, :, 0].numel() * layer.values.element_size() for layer in layers)
        for row, (prompt, gen) in enumerate(zip(prompts, generations)):
            k = min(len(gen.token_ids), cached - width)  # the last sampled token was never fed back
            if not self.prefix_cache.admits(token_bytes * (len(prompt) + k)):
                continue  # over the budget (checked before copying): this episode prefills its history next turn
            columns = torch.cat([attention_mask[row].nonzero().squeeze(1),
                                 torch.arange(width, width + k, device=attention_mask.device)])
            self.prefix_cache.put(CachedPrefix(
                token_ids=tuple(prompt) + tuple(gen.token_ids[:k]),
                keys=[layer.keys[row].index_select(1, columns) for layer in layers],  # (heads, len, head_dim)
                values=[layer.values[row].index_select(1, columns) for layer in layers],
            ))

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
