"""The ``hf`` generation engine: transformers models, with ragen's CPU fast path behind ``rollout.fast_decode``.

It implements :class:`ragen.engines.base.GenerationEngine`: ``generate(token-id prompts, sampling params)`` returns
exactly the ids it sampled (never re-tokenised text), cut right after the first EOS or the first completed stop
string, with the reason it stopped. Built by :func:`ragen.engines.factory.build_engine`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import DynamicCache, DynamicLayer

from ragen.engines.base import Generation, SamplingParams
from ragen.models.cache_names import CACHE_KWARG, output_cache, with_cache
from ragen.models.cast_cache import frozen_weights_cast_once
from ragen.models.decode_attention import decode_attention_for
from ragen.models.decode_loop import DecodeOutput, GeneratedStopStrings, decode, unsupported_setting
from ragen.models.device import model_device
import ragen.models.native_decode as native_decode
from ragen.models.fused_decode import FusedDecoder, compute_dtype, decoder_stack, fused_decode_for
from ragen.models.shared_prefix import PREFIX_PAGE_SPARE, SharedPrefix
from ragen.models.fused_prefill import in_column_chunks, prefill as fused_prefill
from ragen.models.growing_cache import GrowingLayer, make_growing, plain_layers
from ragen.models.precision import resolve_precision
from ragen.models.prefix_cache import CachedPrefix, PrefixKVCache
from ragen.models.sampling import InverseCDFSampler, multinomial_generate_kwargs
from ragen.models.transposed_gemm import transposed_linears

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


@dataclass
class PrefillStats:
    """Where a backend's prompt tokens went: prefilled (``prefill_s`` seconds) or read from a kept cache."""

    #: Prompt tokens run through the model before sampling (the KV cache decoding starts from; with
    #: :attr:`HFBackend.first_from_prefill` also the last prompt tokens, once per distinct prompt), plus the last prompt
    #: tokens a first decode step feeds (each row's; all of a prompt when no prefill ran: ``decode_fed_tokens``).
    prefilled_tokens: int = 0
    #: Prompt tokens whose keys and values came from the previous turn's cache instead.
    reused_tokens: int = 0
    #: Prompt tokens not run because :meth:`HFBackend._common_prefill` ran the distinct prompts' common prefix once
    #: (``c·(U−1)`` per call): the left-padded prefill would have run them. Not in ``prefilled_tokens``.
    common_saved_tokens: int = 0
    #: Of ``prefilled_tokens``, those a decode step rather than a prefill pass ran: each row's last prompt token when
    #: the first decode step feeds it, a whole prompt when no prefill ran (``generate`` prefills itself); 0 when
    #: the prefill ran the last tokens (:attr:`HFBackend.first_from_prefill`).
    decode_fed_tokens: int = 0
    #: Time running prompt tokens through the model before decoding (the fused weights' build excluded).
    prefill_s: float = 0.0
    #: Time decoding (``generate`` or :func:`~ragen.models.decode_loop.decode`), prefill and the build excluded.
    decode_s: float = 0.0
    #: Time building the fused weights (casts, packs; :attr:`~ragen.models.fused_decode.FusedDecoder.build_s`): once
    #: per session, inside the first prefill or decode step that needs them, and counted here instead.
    weights_s: float = 0.0


@dataclass
class Prefilled:
    """A prefill's result: the left-padded (or resumed-layout) ``(B, W)`` ids and mask and the KV cache decoding starts
    from (None: ``generate`` prefills itself). Without ``first_logits`` the cache holds columns ``[0, W-1)`` and the
    first decode step feeds column ``W-1``; with them (``(B, V)``, the logits at each row's last column, which the
    prefill ran) it holds ``[0, W)`` and the first token is sampled from them."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    cache: object | None
    first_logits: torch.Tensor | None = None


class HFBackend:
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
    def from_config(cls, model, tokenizer, config: "RunConfig") -> "HFBackend":
        """The backend a run's config asks for (``trainer.precision``, ``rollout.batch_size``, ``reuse_kv``,
        ``reuse_kv_max_gb``, ``fast_decode``, ``native_decode``); :func:`ragen.engines.factory.build_engine` calls it."""
        r = config.rollout
        return cls(model, tokenizer, precision=config.trainer.precision, batch_size=r.batch_size, reuse_kv=r.reuse_kv,
                   reuse_kv_max_bytes=None if math.isinf(r.reuse_kv_max_gb) else int(r.reuse_kv_max_gb * 2**30),
                   transposed_gemm=r.fast_decode, grow_cache=r.fast_decode, decode_attention=r.fast_decode,
                   fused_decode=r.fast_decode, common_prefix=r.fast_decode, decode_loop=r.fast_decode,
                   fused_prefill=r.fast_decode, first_from_prefill=r.fast_decode,
                   native_decode=r.fast_decode and r.native_decode)

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
                    kept.clear()  # copied into ``cache``: free the entries before decoding
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

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, P) left-padded
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _shared_prefill(self, prompts: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        room: int | None = None, share: bool = False, last: bool = False) -> Prefilled:
        """KV cache of the left-padded prompts, computed once per distinct prompt and copied per row.

        A group's envs share a seed and so, at turn 1, the whole prompt: prefilling ``B`` rows
        that hold only ``U`` distinct prompts costs ``U`` prompt passes instead of ``B``. Without
        ``last`` the last column stays uncached because ``generate`` needs at least one new token to
        start from: the cache covers columns ``[0, P-1)`` of the left-padded layout, with the
        positions ``generate`` itself would use. Done here even when every prompt is distinct
        (the same pass ``generate`` would make), so prefill time is measured apart from
        decoding. The returned :class:`Prefilled` has no cache when the model keeps none (or the
        prompts are one token long): ``generate`` then prefills as usual.

        With ``room`` (the most tokens ``generate`` will add), the cache's layers grow in place
        (:func:`~ragen.models.growing_cache.make_growing`, before the row copy so it copies the
        spare columns too). With ``share`` (the fused decode step is on) and rows in equal
        consecutive groups of a prompt, the prompts' own columns are also kept once per prompt
        (:class:`~ragen.models.shared_prefix.SharedPrefix`) for this call's decode steps.

        With ``last`` the last column is prefilled too, once per distinct prompt, and its logits are returned per row
        (:attr:`Prefilled.first_logits`): ragen's decode loop samples the first token from them.
        """
        if input_ids.shape[1] < 2 or not self.model.config.use_cache:
            self.stats.prefilled_tokens += sum(len(p) for p in prompts)
            self.stats.decode_fed_tokens += sum(len(p) for p in prompts)  # generate runs the whole prompt itself
            return Prefilled(input_ids, attention_mask, None)
        distinct: dict[tuple[int, ...], int] = {}
        row_prompt = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        first_row = {u: row_prompt.index(u) for u in range(len(distinct))}
        rows = torch.tensor([first_row[u] for u in range(len(distinct))], device=input_ids.device)
        end = input_ids.shape[1] if last else -1
        ids, mask = input_ids[rows, :end], attention_mask[rows, :end]  # (U, P-1), or (U, P) with ``last``
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache, logits = self._prompt_pass(last=last, input_ids=ids, attention_mask=mask, position_ids=positions)
        if room is not None:
            make_growing(cache, input_ids.shape[1] + room)
        if len(distinct) < len(prompts):
            if share:
                self._record_shared_prefix(cache, row_prompt, len(distinct), padding=mask == 0, room=room)
            cache.reorder_cache(torch.tensor(row_prompt, device=input_ids.device))  # (U, ...) -> (B, ...)
        if last:
            self.stats.prefilled_tokens += sum(len(p) for p in distinct)
            logits = logits[torch.tensor(row_prompt, device=logits.device)]  # (U, V) -> (B, V)
        else:  # + each row's last token, which the first decode step feeds
            self.stats.prefilled_tokens += sum(len(p) - 1 for p in distinct) + len(prompts)
            self.stats.decode_fed_tokens += len(prompts)
        return Prefilled(input_ids, attention_mask, cache, logits)

    def _record_shared_prefix(self, cache, row_prompt: list[int], distinct: int, padding: torch.Tensor,
                              room: int | None) -> None:
        """Keep the ``distinct`` prompts' prefilled columns once each for this call's fused decode steps, if rows
        ``row_prompt`` come in equal consecutive groups (:class:`~ragen.models.shared_prefix.SharedPrefix`).

        ``cache`` holds one row per distinct prompt (before the row copy); ``padding`` ``(U, L)`` marks its padding
        columns; with ``room`` (growing caches) the rows' own columns are read per group too, for that many steps.
        """
        group = len(row_prompt) // distinct
        if row_prompt == [u for u in range(distinct) for _ in range(group)]:
            capacity = (room or 0) if self.fused.group_own_columns else 0
            pages = self.fused.prefix_pages if self._in_session else None  # outside a session nothing would free them
            self.fused.prefix = SharedPrefix.from_layers(cache.layers, group, padding=padding, capacity=capacity,
                                                         pages=pages)

    def _record_rows_as_groups_of_one(self, prefilled: "Prefilled", room: int) -> None:
        """Let the C++ step decode a resumed turn: each row's cache as the shared prefix of a group of one.

        A resumed turn's rows share no prompt, so their steps would run in Python with per-row attention over each
        row's whole kept history. The C++ grouped step (:mod:`ragen.models.native_decode`) computes groups of one as
        well; the price is one copy of the cache into :class:`~ragen.models.shared_prefix.SharedPrefix`'s fp32 layout.
        On a 2-core Zen 5 (64 Sokoban envs × 5 turns, alternated) decode per generated token went 2.80 → 1.39 ms and the
        whole rollout 53.5-53.9 → 42.0-42.7 s, copies included (``benchmarks/bench_multiturn.py``). Only
        where the C++ step can take the steps (bf16, kernels built): the Python step gains nothing from the copy. The
        copy (fp32 keys and values of every row's columns, on pages kept for the session that may grow to
        :data:`~ragen.models.shared_prefix.PREFIX_PAGE_SPARE` times it) is skipped where those pages would exceed the
        kept caches' own bound (``rollout.reuse_kv_max_gb``): such calls decode in Python as before.
        """
        cache = prefilled.cache
        if cache is None or not self.fused.group_own_columns or native_decode.failed is not None:
            return  # the kernel reads own columns per group; after a refusal every step runs in Python
        if compute_dtype(self.model) != torch.bfloat16 or self.fused.native_ops(torch.bfloat16) is None:
            return
        if not cache.layers or not all(type(layer) is GrowingLayer for layer in cache.layers):
            return
        n, L = prefilled.input_ids.shape[0], cache.get_seq_length()
        bound = self.prefix_cache.max_bytes if self.prefix_cache is not None else None
        keys, values = cache.layers[0].filled_views()
        copy_bytes = len(cache.layers) * n * keys.shape[1] * (L + room) * (keys.shape[-1] + values.shape[-1]) * 4
        if bound is not None and copy_bytes * PREFIX_PAGE_SPARE > bound:
            return
        self._record_shared_prefix(cache, list(range(n)), n, padding=prefilled.attention_mask[:, :L] == 0, room=room)

    def _prompt_pass(self, last: bool = False, **inputs):
        """Run prompt tokens through the model for their keys and values; returns the KV cache and, with ``last``, the
        logits at each row's last column ``(B, V)`` (else None).

        Llama-family models of transformers' own classes run their decoder alone
        (:func:`~ragen.models.fused_decode.decoder_stack`): the logits would be thrown away. Others run whole,
        with ``logits_to_keep=1``. Within a call whose decode steps are fused, the prefill runs through the same
        packed weights (:func:`~ragen.models.fused_prefill.prefill`) where the cache and inputs allow it. Either way a
        pass of more than :data:`~ragen.models.fused_prefill.PASS_TOKENS` tokens runs in column chunks, each appending
        to the cache before the next (the same keys and values up to float rounding; measured in
        ``benchmarks/bench_decode.py``).
        """
        cache, ids, mask = inputs.get(CACHE_KWARG), inputs["input_ids"], inputs.get("attention_mask")
        fits = inputs.get("position_ids") is not None and (plain_layers(cache) if cache is not None else self._plain_cache_layers())
        if self._prefill_fused and fits:
            weights = self.fused.weights_for(self.model, compute_dtype(self.model))  # for the prefill and the decode steps
            self.fused.prefill_calls += 1
            return fused_prefill(self.model, weights, ids, mask, inputs["position_ids"], cache, last=last)
        if fits and mask is not None:
            def chunk_pass(chunk_ids, chunk_mask, positions, chunk_cache, chunk_last):
                cached = with_cache(chunk_cache) if chunk_cache is not None else {}
                return self._transformers_pass(chunk_last, input_ids=chunk_ids, attention_mask=chunk_mask,
                                               position_ids=positions, **cached)

            return in_column_chunks(chunk_pass, ids, mask, inputs["position_ids"], cache, last)
        return self._transformers_pass(last, **inputs)

    def _transformers_pass(self, last: bool, **inputs):
        """One prompt pass through transformers' modules (see :meth:`_prompt_pass`): ``(cache, logits or None)``."""
        decoder = decoder_stack(self.model)
        if decoder is None or last:
            out = self.model(**inputs, use_cache=True, logits_to_keep=1)
            return output_cache(out), (out.logits[:, -1] if last else None)
        return output_cache(decoder(**inputs, use_cache=True)), None

    def _resume_prefill(self, prompts: list[list[int]], kept: list[CachedPrefix | None], room: int | None = None,
                        count: bool = True, last: bool = False) -> Prefilled:
        """Left-padded ids, mask and a KV cache for ``prompts`` where row ``i`` starts with ``kept[i]``.

        Columns ``[0, C)`` hold each row's kept prefix (``c_i`` tokens, right-aligned, from the
        stored keys and values), columns ``[C, C + S)`` the rest of its prompt but the last
        token (``s_i`` tokens, right-aligned), column ``C + S`` the last token, which
        ``generate`` feeds itself. Only the ``[C, C + S)`` block is run through the model.
        The mask may hold padding between a row's two parts; positions count only real
        tokens (``cumsum`` of the mask, as ``generate`` computes them), so each token gets
        the position it had when its keys were first computed. With ``room``, the cache grows in
        place (see :meth:`_shared_prefill`). With ``last`` the last column runs too and its logits are returned
        (:attr:`Prefilled.first_logits`).
        """
        n = len(prompts)
        reused = [min(len(k), len(p) - 1) if k is not None else 0 for k, p in zip(kept, prompts)]  # c_i
        rest = [len(p) - 1 - c for p, c in zip(prompts, reused)]  # s_i
        C, S = max(reused), max(rest)
        input_ids = torch.full((n, C + S + 1), self.pad_id, dtype=torch.long)  # (B, C+S+1)
        attention_mask = torch.zeros_like(input_ids)
        for row, (prompt, c, s) in enumerate(zip(prompts, reused, rest)):
            input_ids[row, C - c : C] = torch.tensor(prompt[:c], dtype=torch.long)
            input_ids[row, C + S - s : C + S] = torch.tensor(prompt[c : c + s], dtype=torch.long)
            input_ids[row, -1] = prompt[-1]
            attention_mask[row, C - c : C] = 1
            attention_mask[row, C + S - s :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        sample = next(k for k in kept if k is not None)
        cache = DynamicCache(config=self.model.config)
        for layer, (k0, v0) in enumerate(zip(sample.keys, sample.values)):
            # (B, heads, C, head_dim) each: the kept prefixes right-aligned; padding columns are masked out but must
            # hold finite numbers (a masked column's value still meets a probability of 0)
            in_place = room is not None and layer < len(cache.layers) and type(cache.layers[layer]) is DynamicLayer
            if in_place:  # straight into a buffer with room for the rest (no second copy by make_growing)
                grown = GrowingLayer.allocate(k0, v0, n, C, C + S + 1 + room)
                keys, values = grown.filled_views()
            else:
                keys, values = k0.new_empty(n, k0.shape[0], C, k0.shape[-1]), v0.new_empty(n, v0.shape[0], C, v0.shape[-1])
            for row, (entry, c) in enumerate(zip(kept, reused)):
                if c < C:
                    keys[row, :, : C - c].zero_()
                    values[row, :, : C - c].zero_()
                if c:
                    keys[row, :, C - c :].copy_(entry.keys[layer][:, :c])
                    values[row, :, C - c :].copy_(entry.values[layer][:, :c])
            if in_place:
                cache.layers[layer] = grown
            else:
                cache.update(keys, values, layer)
        if room is not None:
            make_growing(cache, C + S + 1 + room)  # any layer not built in place above
        end = C + S + int(last)  # the columns [C, end) run through the model
        logits = None
        if end > C:
            positions = (attention_mask.cumsum(1) - 1).clamp(min=0)
            _, logits = self._prompt_pass(last=last, input_ids=input_ids[:, C:end], attention_mask=attention_mask[:, :end],
                                          position_ids=positions[:, C:end], **with_cache(cache))
        if count:  # (False: the caller counts, as _common_prefill, whose "kept" prefix is no earlier turn's)
            self.stats.reused_tokens += sum(reused)
            self.stats.prefilled_tokens += sum(rest) + n  # + each row's last token (here, or by the first decode step)
            self.stats.decode_fed_tokens += 0 if last else n
        return Prefilled(input_ids, attention_mask, cache, logits)

    def _common_prefill(self, prompts: list[list[int]], room: int | None = None, share: bool = False,
                        last: bool = False) -> Prefilled | None:
        """Left-padded-by-parts ids, mask and KV cache for ``prompts`` whose distinct prompts share their first tokens.

        Prompts rendered from one template (the system prompt, the game's rules) differ only after a
        common prefix: the bandit preset's prompts share 63 of their ~109 tokens. Its keys and values are
        the same in every row -- positions start at each row's first real token -- so they are computed once,
        in a pass of one row, and each distinct prompt's rest runs on top of them
        (:meth:`_resume_prefill`'s layout: ``[common | padding | rest]``, positions counting real tokens
        only), once per distinct prompt; rows are then copied out as in :meth:`_shared_prefill`. Prefill work
        goes from ``U·P`` tokens to ``c + U·(P - c)``. The same keys, values and logits as the left-padded
        prefill, up to float rounding (GEMMs of other row counts may sum in another order).

        None (nothing done) when fewer than two distinct prompts, fewer than :attr:`min_common_prefix` common
        tokens or :attr:`min_common_saved` tokens saved, or the model's cache is not a plain per-layer cache.
        """
        if not self.model.config.use_cache:
            return None
        distinct = list(dict.fromkeys(tuple(p) for p in prompts))
        common = min(len(os.path.commonprefix(distinct)), min(map(len, distinct)) - 1)  # the last token stays for generate
        if len(distinct) < 2 or common < self.min_common_prefix or common * (len(distinct) - 1) < self.min_common_saved:
            return None
        if not self._plain_cache_layers():
            return None  # sliding-window, quantised, ... caches: the left-padded prefill handles them
        ids = torch.tensor([distinct[0][:common]], device=self.device)  # (1, c)
        shared, _ = self._prompt_pass(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      position_ids=torch.arange(common, device=self.device)[None])
        entry = CachedPrefix(token_ids=distinct[0][:common], keys=[layer.keys[0] for layer in shared.layers],
                             values=[layer.values[0] for layer in shared.layers])  # (heads, c, head_dim) per layer
        resumed = self._resume_prefill([list(p) for p in distinct], [entry] * len(distinct), room, count=False, last=last)
        input_ids, attention_mask, cache, logits = resumed.input_ids, resumed.attention_mask, resumed.cache, resumed.first_logits
        del entry, shared, resumed
        # the common tokens ran once, each distinct prompt's rest once, each row's last token (once per distinct
        # prompt with ``last``, else by the first decode step)
        if last:
            self.stats.prefilled_tokens += common + sum(len(p) - common for p in distinct)
        else:
            self.stats.prefilled_tokens += common + sum(len(p) - 1 - common for p in distinct) + len(prompts)
            self.stats.decode_fed_tokens += len(prompts)
        self.stats.common_saved_tokens += common * (len(distinct) - 1)
        index = {p: u for u, p in enumerate(distinct)}
        row_prompt = [index[tuple(p)] for p in prompts]
        if share and len(distinct) < len(prompts):
            columns = attention_mask if last else attention_mask[:, :-1]  # the cache's columns
            self._record_shared_prefix(cache, row_prompt, len(distinct), padding=columns == 0, room=room)
        if row_prompt == list(range(len(distinct))):
            return Prefilled(input_ids, attention_mask, cache, logits)  # every row its own prompt, in order: no copy
        rows = torch.tensor(row_prompt, device=input_ids.device)
        cache.reorder_cache(rows)  # (U, ...) -> (B, ...)
        return Prefilled(input_ids[rows], attention_mask[rows], cache, logits[rows] if logits is not None else None)

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
