"""Per-token log-probs, entropy and critic values, computed only where a loss needs them.

The LM head runs on the hidden states of response positions only, in chunks, so logits
are never materialised for the whole ``B × T × V`` block (for SmolLM2 V = 49 152: a 64 ×
512 batch would be 6 GB in fp32). Works for any HF causal LM whose logits are
``lm_head(decoder(x))`` (``get_decoder`` / ``get_output_embeddings``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ragen.models.cache_names import output_cache, with_cache
from ragen.models.checkpointing import is_checkpointing
from ragen.models.lora import base_model
from ragen.models.train_attention import train_attention_for
from ragen.train.packed_groups import (block_mask, group_widths, pack_groups, packed_is_cheaper, packing_supported,
                                       pair_cost_in_tokens)
from ragen.train.target_logprobs import target_logprobs
from ragen.train.tied_embedding import tied_weight_for


@dataclass
class PolicyOutput:
    logprobs: torch.Tensor  # (B, T) log π(x_{t+1} | x_{≤t}), zero off the response mask
    entropy: torch.Tensor | None  # (B, T) entropy of π(· | x_{≤t}), zero off the mask
    values: torch.Tensor | None  # (B, T) critic value of the state x_{≤t}, zero off the mask


def embeds_equal_ids(decoder) -> bool:
    """Whether ``decoder(inputs_embeds=embed(ids))`` computes what ``decoder(input_ids=ids)`` does.

    True for transformers' causal decoders in general (Llama, Qwen, Mistral, Gemma: Gemma scales the
    embeddings after this branch). Not for decoders that scale only in the ``input_ids`` branch
    (``embed_scale``, e.g. MVP) or derive more inputs from the ids (Gemma 3n's ``per_layer_inputs``).
    """
    if hasattr(decoder, "embed_scale"):
        return False
    return "per_layer_inputs" not in inspect.signature(decoder.forward).parameters


#: How :func:`decoder_hidden` lays out rows that share a prompt (:mod:`ragen.train.packed_groups`).
PROMPT_LAYOUTS = ("auto", "split", "packed")


@dataclass
class _RowGroups:
    """A right-padded CPU batch's rows grouped by their shared prompt."""

    lengths: list[int]  # (B,) tokens per row
    plens: list[int]  # (B,) prompt tokens per row
    row_prompt: list[int]  # (B,) index of the row's prompt in ``prompts``
    prompts: list[tuple[int, ...]]  # the distinct prompts, in order of first appearance

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor) -> "_RowGroups":
        lengths = attention_mask.sum(1).tolist()  # (B,)
        plens = [max(1, int(p)) for p in prompt_lengths.tolist()]
        for r, (n, p) in enumerate(zip(lengths, plens)):
            if p > n:
                raise ValueError(f"row {r}: a prompt of {p} tokens in a row of {n} (an empty row?)")
        index: dict[tuple[int, ...], int] = {}
        row_prompt = [index.setdefault(tuple(input_ids[r, :p].tolist()), len(index)) for r, p in enumerate(plens)]
        return cls(lengths, plens, row_prompt, list(index))

    def packable(self, decoder) -> bool:
        return packing_supported(decoder, max(group_widths(self.lengths, self.plens, self.row_prompt, len(self.prompts))))

    def packing_pays(self, decoder) -> bool:
        return self.packable(decoder) and packed_is_cheaper(self.lengths, self.plens, self.row_prompt, len(self.prompts),
                                                            pair_cost_in_tokens(decoder))


def shared_prompt_layout(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         prompt_lengths: torch.Tensor | None) -> str:
    """The layout :func:`decoder_hidden`'s ``"auto"`` takes for this batch: ``"packed"`` or ``"split"``.

    For callers that must agree across processes before the pass (FSDP ranks: every decoder pass is a
    collective, and the two layouts run different numbers of passes). ``"split"`` also when nothing is
    shared (``prompt_lengths`` None) or the model is checkpointed: then the plain pass runs either way.
    """
    decoder = base_model(model).get_decoder()
    if prompt_lengths is None or (decoder.training and is_checkpointing(model)):
        return "split"
    groups = _RowGroups.of(input_ids.cpu(), attention_mask.cpu(), prompt_lengths)
    return "packed" if groups.packing_pays(decoder) else "split"


def decoder_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   prompt_lengths: torch.Tensor | None = None, layout: str = "auto") -> torch.Tensor:
    """Last hidden states ``(B, L, H)`` of a right-padded batch.

    With ``prompt_lengths`` (``(B,)``, tokens before each row's first model-written token), rows
    that start with the same prompt -- every env of a group shares its seed, so its first prompt --
    run that prompt once, in one of two layouts (:mod:`ragen.train.packed_groups`):

    - ``"split"``: the prompts go through the decoder as one left-padded batch, their KV cache is
      copied to each row (``index_select``, differentiable), and only the rows' own continuations
      are computed on top, in a second pass;
    - ``"packed"``: one pass over one row per group (its prompt, then its rows' continuations) under
      a block mask, where the model's attention takes a dense mask and no sliding window applies;
    - ``"auto"`` (default): ``"packed"`` where it is supported and costs less by
      :func:`~ragen.train.packed_groups.packed_is_cheaper`, else ``"split"``.

    Either equals the plain pass up to float rounding, at a fraction of the cost when prompts are
    long and answers short. The index tensors are built on the CPU and moved to ``input_ids``'
    device (the model's).
    """
    if layout not in PROMPT_LAYOUTS:
        raise ValueError(f"layout must be one of {PROMPT_LAYOUTS}, got {layout!r}")
    decoder = base_model(model).get_decoder()
    if prompt_lengths is not None and decoder.training and is_checkpointing(model):
        prompt_lengths = None  # a checkpointed layer cannot write the prompts' KV cache: full rows
    if prompt_lengths is None:
        return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state  # no KV cache to keep
    device = input_ids.device
    input_ids, attention_mask = input_ids.cpu(), attention_mask.cpu()  # read row by row below: one copy, not B syncs
    B, L = input_ids.shape
    groups = _RowGroups.of(input_ids, attention_mask, prompt_lengths)
    lengths, plens, row_prompt, prompts = groups.lengths, groups.plens, groups.row_prompt, groups.prompts
    pad = int(input_ids[0, -1]) if attention_mask[0, -1] == 0 else 0
    if layout == "packed" and not groups.packable(decoder):
        raise ValueError("the packed layout needs a dense-mask attention (sdpa, eager or ragen's grouped one), every "
                         "layer full attention and no sliding window a packed row could exceed")
    if layout == "packed" or (layout == "auto" and groups.packing_pays(decoder)):
        return _packed_hidden(decoder, input_ids, attention_mask, lengths, plens, row_prompt, len(prompts), pad, device)
    P = max(len(p) for p in prompts)
    prompt_ids = torch.full((len(prompts), P), pad, dtype=input_ids.dtype)  # (G, P) left-padded
    prompt_mask = torch.zeros((len(prompts), P), dtype=attention_mask.dtype)
    for g, p in enumerate(prompts):
        prompt_ids[g, P - len(p) :] = torch.tensor(p)
        prompt_mask[g, P - len(p) :] = 1
    suffix_lens = [lengths[r] - plens[r] for r in range(B)]
    S = max(suffix_lens)
    suffix_ids = torch.full((B, S), pad, dtype=input_ids.dtype)  # (B, S) right-padded continuations
    suffix_mask = torch.zeros((B, S), dtype=attention_mask.dtype)
    for r in range(B):
        suffix_ids[r, : suffix_lens[r]] = input_ids[r, plens[r] : lengths[r]]
        suffix_mask[r, : suffix_lens[r]] = 1
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    suffix_ids, suffix_mask = suffix_ids.to(device), suffix_mask.to(device)
    if embeds_equal_ids(decoder):
        # One embedding lookup for both passes: its backward builds a dense (V, H) gradient per call
        # (embedding_dense_backward), 113 MB of fresh zeros for SmolLM2, so one call instead of two.
        embedded = decoder.get_input_embeddings()(torch.cat([prompt_ids.reshape(-1), suffix_ids.reshape(-1)]))  # (G·P + B·S, H)
        prompt_in = {"inputs_embeds": embedded[: prompt_ids.numel()].view(*prompt_ids.shape, embedded.shape[-1])}  # (G, P, H)
        suffix_in = {"inputs_embeds": embedded[prompt_ids.numel() :].view(B, S, embedded.shape[-1])}  # (B, S, H)
    else:
        prompt_in, suffix_in = {"input_ids": prompt_ids}, {"input_ids": suffix_ids}
    prompt_out = decoder(**prompt_in, attention_mask=prompt_mask,
                         position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0), use_cache=True)
    rows = []
    if S > 0:
        cache = output_cache(prompt_out)
        index = torch.tensor(row_prompt, device=device)
        cache.reorder_cache(index)  # (G, ...) -> (B, ...), one copy of its prompt's cache per row
        positions = (torch.tensor(plens)[:, None] + torch.arange(S)[None, :]).to(device)  # (B, S)
        suffix_hidden = decoder(**suffix_in, attention_mask=torch.cat([prompt_mask[index], suffix_mask], 1),
                                position_ids=positions, use_cache=True, **with_cache(cache)).last_hidden_state
    prompt_hidden = prompt_out.last_hidden_state  # (G, P, H)
    for r in range(B):
        parts = [prompt_hidden[row_prompt[r], P - plens[r] :]]
        if suffix_lens[r] > 0:
            parts.append(suffix_hidden[r, : suffix_lens[r]])
        rows.append(torch.cat(parts, 0))  # (len_r, H)
    hidden = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # (B, max len, H)
    if hidden.shape[1] < L:
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, L - hidden.shape[1]))
    return hidden


def _packed_hidden(decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: list[int],
                   plens: list[int], row_group: list[int], groups: int, pad: int, device) -> torch.Tensor:
    """:func:`decoder_hidden`'s packed layout: one decoder pass over ``(G, T)``, gathered back to ``(B, L, H)``."""
    packing = pack_groups(input_ids, lengths, plens, row_group, groups, pad)
    mask = block_mask(packing.segments, decoder.config._attn_implementation,
                      decoder.get_input_embeddings().weight.dtype).to(device)  # (G, 1, T, T)
    packed = decoder(input_ids=packing.input_ids.to(device), attention_mask=mask,
                     position_ids=packing.position_ids.to(device), use_cache=False).last_hidden_state  # (G, T, H)
    G, T, H = packed.shape
    rows = packed.reshape(G * T, H).index_select(0, packing.gather.view(-1).to(device))  # (B·L, H)
    keep = attention_mask.to(device=device, dtype=rows.dtype).reshape(-1, 1)  # (B·L, 1): zero past each row's end
    return (rows * keep).view(*packing.gather.shape, H)  # (B, L, H)


def policy_forward(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    value_head: torch.nn.Module | None = None,
    prompt_lengths: torch.Tensor | None = None,
    prompt_layout: str = "auto",
    chunk_size: int = 1024,
    tied_weight: bool = True,
    fast: bool = True,
) -> PolicyOutput:
    """One decoder pass → log-probs (and entropy, values) at response targets.

    Args:
        input_ids, attention_mask: ``(B, L)``.
        response_mask: ``(B, T)`` with ``T = L - 1``; targets where results are needed.
        temperature: logits are divided by it, matching the sampling distribution (skipped at 1.0:
            ``x / 1.0 == x`` exactly, and the division is a full pass over ``(n, V)`` forward and backward).
        with_entropy: also return the entropy ``H_t = -Σ_v π_v log π_v``.
        entropy_grad: False when the entropy is only a metric (no entropy bonus). Log-probs (and a metric
            entropy) come from :func:`~ragen.train.target_logprobs.target_logprobs` (fp32 row blocks, a
            hand-written backward, no ``(n, V)`` fp32 copies) unless ``with_entropy and entropy_grad``,
            which keeps autograd through the whole log-softmax for the entropy's gradient.
        value_head: a module mapping hidden states ``(N, H)`` to values ``(N,)`` (shared-backbone critic).
        prompt_lengths: ``(B,)``; run shared prompts once (see :func:`decoder_hidden`).
        prompt_layout: how (:data:`PROMPT_LAYOUTS`, see :func:`decoder_hidden`); ``"auto"`` picks the cheaper.
        tied_weight: a tied embedding / LM-head weight accumulates its gradient in kept memory where
            :class:`~ragen.train.tied_embedding.TiedWeight` applies (False: autograd's path, for comparisons).
        fast: False runs the plain transformers path, the reference the speed-ups are tested against
            (``algorithm.fast_update``): one decoder pass over full rows in the model's own attention, the LM head
            through autograd's log-softmax; no shared prompts, grouped attention, hand-written backward or kept
            tied-weight gradient.
    """
    if not fast:
        return _plain_policy_forward(model, input_ids, attention_mask, response_mask, temperature, with_entropy,
                                     value_head)
    base = base_model(model)
    # a tied embedding / LM-head weight accumulates its gradient in kept memory (ragen/train/tied_embedding.py):
    # within this block both modules' calls take that path
    with tied_weight_for(base, enabled=tied_weight):
        # grouped fp32 attention where it fits (ragen/models/train_attention.py); not on a checkpointed model,
        # whose backward recomputes the layers after this block has switched the implementation back
        with train_attention_for(model, enabled=not (torch.is_grad_enabled() and is_checkpointing(model))):
            hidden = decoder_hidden(model, input_ids, attention_mask, prompt_lengths, prompt_layout)  # (B, L, H)
        where = response_mask.bool()  # (B, T)
        h = hidden[:, :-1][where]  # (N, H) hidden states that predict a response token
        targets = input_ids[:, 1:][where]  # (N,)
        logp_parts, ent_parts = _head_logprobs(base.get_output_embeddings(), h, targets, temperature, with_entropy,
                                               entropy_grad, chunk_size)

    def scatter(parts: list[torch.Tensor]) -> torch.Tensor:
        return _at_targets(torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32), where)

    return PolicyOutput(
        logprobs=scatter(logp_parts),
        entropy=scatter(ent_parts) if with_entropy else None,
        values=scatter([value_head(h).float()]) if value_head is not None else None,
    )


def _plain_policy_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                          temperature: float, with_entropy: bool, value_head: torch.nn.Module | None) -> PolicyOutput:
    """:func:`policy_forward` with ``fast=False``: transformers' decoder on full rows, then
    ``log_softmax(lm_head(h) / T)`` at the targets, all through autograd."""
    base = base_model(model)
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    where = response_mask.bool()  # (B, T)
    h = hidden[:, :-1][where]  # (N, H)
    logits = base.get_output_embeddings()(h).float() / temperature  # (N, V)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:][where][:, None]).squeeze(-1)  # (N,)

    return PolicyOutput(
        logprobs=_at_targets(logp, where),
        entropy=_at_targets(-(logp_all.exp() * logp_all).sum(-1), where) if with_entropy else None,
        values=_at_targets(value_head(h).float(), where) if value_head is not None else None,
    )


def _at_targets(flat: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``(N,)`` values, one per ``True`` of ``where`` ``(B, T)``, placed there in a ``(B, T)`` fp32 tensor of zeros."""
    return torch.zeros(where.shape, dtype=torch.float32, device=flat.device).masked_scatter(where, flat.float())


def _head_logprobs(head, h: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                   entropy_grad: bool, chunk_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`policy_forward`'s LM head on ``h`` ``(N, H)`` in chunks of ``chunk_size`` rows: per chunk ``log π(target)``
    ``(n,)`` and, with ``with_entropy``, the entropy ``(n,)``."""
    logp_parts, ent_parts = [], []
    for start in range(0, h.shape[0], chunk_size):
        logits = head(h[start : start + chunk_size])  # (n, V), bf16 under autocast
        chunk_targets = targets[start : start + chunk_size]  # (n,)
        if with_entropy and entropy_grad:  # an entropy bonus: autograd through the whole log-softmax
            logits = logits.float()  # (n, V) fp32 for a stable softmax
            if temperature != 1.0:
                logits = logits / temperature
            logp_all = torch.log_softmax(logits, dim=-1)
            logp_parts.append(logp_all.gather(-1, chunk_targets[:, None]).squeeze(-1))
            ent_parts.append(-(logp_all.exp() * logp_all).sum(-1))
        else:  # fp32 in row blocks, no (n, V) fp32 copies (ragen/train/target_logprobs.py)
            # the chunk's logits are read nowhere else: the backward may store their gradient in place
            logp, entropy = target_logprobs(logits, chunk_targets, temperature, with_entropy, overwrite_logits=True)
            logp_parts.append(logp)
            if with_entropy:
                ent_parts.append(entropy)
    return logp_parts, ent_parts


def token_logprobs(model, input_ids, attention_mask, response_mask, *, temperature=1.0, with_entropy=False, chunk_size=1024):
    """``(logprobs, entropy)`` at response targets; see :func:`policy_forward`."""
    out = policy_forward(model, input_ids, attention_mask, response_mask, temperature=temperature,
                         with_entropy=with_entropy, chunk_size=chunk_size)
    return out.logprobs, out.entropy


class ValueHead(torch.nn.Module):
    """Scalar value of each position's hidden state: ``V(s_t) = w·h_t + b`` (zero-initialised)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N,)
        return self.linear(hidden.float()).squeeze(-1)
