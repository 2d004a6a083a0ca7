"""Prompt prefill of the ``hf`` engine: the KV cache that decoding starts from.

:class:`PromptPrefill` is the half of :class:`~ragen.models.backend.HFBackend` that runs prompt tokens through the
model before sampling: left padding, one pass per distinct prompt copied to its group's rows (``_shared_prefill``),
the prompts' common prefix run once (``_common_prefill``), a turn resumed from the previous turn's kept cache
(``_resume_prefill``), and the pass itself on the fused weights or through transformers (``_prompt_pass``). It reads
the backend's ``model``, ``fused``, ``stats``, ``prefix_cache``, ``pad_id`` and ``device``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

import ragen.models.native_decode as native_decode
from ragen.models.cache_names import CACHE_KWARG, output_cache, with_cache
from ragen.models.fused_decode import compute_dtype, decoder_stack
from ragen.models.fused_prefill import in_column_chunks, prefill as fused_prefill
from ragen.models.growing_cache import GrowingLayer, make_growing, plain_layers
from ragen.models.prefix_cache import CachedPrefix
from ragen.models.shared_prefix import PREFIX_PAGE_SPARE, SharedPrefix

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



class PromptPrefill:
    """Prompt passes before decoding; mixed into :class:`~ragen.models.backend.HFBackend`."""

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
