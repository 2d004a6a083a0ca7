"""One-token decode steps of Llama-family models as a short loop of fused projections, for generation on the CPU.

During decoding every row brings one token, so a step of a 30-layer model is ~1 500 small ATen calls
from transformers' modules (per layer: seven projections, rotary embedding, the cache update, the
attention call, two RMS norms, residual adds, autocast casts of the same input for each projection)
plus their Python. On a 2-core CPU that overhead is as large as the GEMMs themselves. This module
computes the same step with far fewer calls:

- the query, key and value projections as one GEMM on a concatenated ``[W_q; W_k; W_v]`` and the MLP's
  gate and up projections as one on ``[W_gate; W_up]`` (each output column is the same dot product
  as in the separate projection);
- each weight cast once to the autocast dtype (bf16) and packed for oneDNN
  (:mod:`ragen.models.packed_linear`), kept for the whole rollout session instead of looked up in
  autocast's cache at every call and repacked by the BLAS at every GEMM (measured with the packing cost:
  1.03-1.06x per ``generate`` call of 16-32 tokens at batch 32, ``docs/performance.md``); in fp32 the LM
  head is packed for oneDNN and q/k/v, o and gate/up for MKL's packed GEMM at the decode batch;
- the query and key heads rotated together, attention for one query per row as two fp32 matmuls per
  KV head group (as :mod:`ragen.models.decode_attention`), with a key-padding mask when rows are
  left-padded; with a :class:`SharedPrefix`, per group of rows sharing a prompt.

The arithmetic is the model's own, in the same dtypes as transformers' path under ``generate``'s
autocast: an fp32 residual stream, RMS norms in fp32, projections in the autocast dtype (bf16; else
the weights' dtype), rotary embedding from the model's own ``rotary_emb`` module (keys fp32, values
in the projection's dtype, as transformers caches them). Attention is fp32 matmuls and an fp32 softmax,
as :mod:`ragen.models.decode_attention` computes unmasked calls; for masked calls (left padding)
transformers' ``sdpa`` runs in bf16 under autocast, so there the fused step is the more precise of
the two. Results equal transformers' up to float rounding (oneDNN's packed GEMMs may sum in
another order), which the tests bound (``tests/models/test_fused_decode.py``: fp32 within 1e-5;
bf16 no further from an fp32 reference than transformers' bf16 path). Measured in
``benchmarks/bench_decode.py --sections fused``.

Only what is known to compute exactly this is taken (:func:`unsupported_reason`): models of the
``llama``, ``mistral`` (without a sliding window) and ``qwen2`` (full attention) types, built from
transformers' own layer classes with plain ``nn.Linear`` projections (no LoRA wrapper, no quantised or
sharded weights, no hooks), SiLU MLPs, on the CPU, in eval mode, with autograd off, one new token
per row on a non-empty full-attention cache and a 2-D padding mask. Every other call --
prefill, a model under LoRA, a hooked model, training -- runs transformers' ``forward`` unchanged.
:func:`fused_decode_for` switches a model for a ``with`` block and restores it on exit.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2

import ragen.models.decode_attention as decode_attention
import ragen.models.native as native
import ragen.models.native_decode as native_decode
import ragen.models.train_attention as train_attention
from ragen.models.decode_attention import grouped_one_query
from ragen.models.cache_names import CACHE_KWARG
from ragen.models.lora import base_model
from ragen.models.growing_cache import GrowingLayer, plain_layers
from ragen.models.kept_buffer import KeptBuffer
from ragen.models.fused_weights import MKL_PACK_MIN_STEPS, FusedWeights, _LayerWeights
from ragen.models.shared_prefix import SharedPrefix, _attend_grouped, _attend_shared

#: ``config.model_type`` -> transformers' (causal LM, decoder layer, attention, MLP, RMS norm) classes of the
#: pre-norm Llama block computed here. Exact classes: a subclass or a remote-code look-alike may compute
#: something else.
SUPPORTED = {
    "llama": (llama.LlamaForCausalLM, llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP, llama.LlamaRMSNorm),
    "mistral": (mistral.MistralForCausalLM, mistral.MistralDecoderLayer, mistral.MistralAttention, mistral.MistralMLP,
                mistral.MistralRMSNorm),
    "qwen2": (qwen2.Qwen2ForCausalLM, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention, qwen2.Qwen2MLP, qwen2.Qwen2RMSNorm),
}
SUPPORTED_MODEL_TYPES = tuple(SUPPORTED)
#: Keyword arguments ``generate`` passes to the forward that do not change a decode step's logits (the
#: ``tokenizer`` comes along when stop strings are set). Any other one set to a value hands the call to transformers.
IGNORED_KWARGS = frozenset({CACHE_KWARG, "return_dict", "cache_position", "tokenizer"})
#: Attention implementations that compute plain softmax attention (what :func:`decode_step` computes).
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", decode_attention.NAME, train_attention.NAME)


def _plain_linear(module) -> bool:
    return (type(module) is torch.nn.Linear and "forward" not in vars(module)
            and type(module.weight.data) is torch.Tensor and module.weight.device.type == "cpu")


def _hooked(module: torch.nn.Module) -> bool:
    return any(bool(m._forward_hooks or m._forward_pre_hooks) for m in module.modules())


def _own_forward(module, cls) -> bool:
    """``module`` is exactly ``cls`` and runs the class's ``forward`` (no instance patch)."""
    return type(module) is cls and "forward" not in vars(module)


def decoder_stack(model) -> torch.nn.Module | None:
    """The decoder (embeddings, layers, final norm; no LM head) of a ``llama``/``mistral``/``qwen2`` causal LM of
    transformers' own class, through a peft wrapper (its adapters live inside the layers); None for other models.

    A prompt prefill that only needs the KV cache calls it instead of the whole model: no logits, and under
    autocast no bf16 cast of the LM head's weight (a 49 152 × 576 copy per call for SmolLM2).
    """
    base = base_model(model)
    spec = SUPPORTED.get(getattr(getattr(base, "config", None), "model_type", None))
    if spec is None or type(base) is not spec[0] or not isinstance(getattr(base, "model", None), torch.nn.Module):
        return None
    return base.model


def unsupported_reason(model) -> str | None:
    """Why :func:`fused_decode_for` would leave ``model``'s decode steps to transformers, or None if it takes them."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None or not hasattr(model, "lm_head") or not hasattr(inner, "layers"):
        return "not a decoder-only causal LM with .model.layers and .lm_head"
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model_type {getattr(config, 'model_type', None)!r} not in {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "sub_configs", None):
        return "composite config"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
        return "MLP is not a bias-free SiLU gate"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "layers other than full attention"
    if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding-window attention"
    if getattr(config, "_attn_implementation", None) not in ATTENTION_IMPLEMENTATIONS:
        return f"attention implementation {getattr(config, '_attn_implementation', None)!r}"
    model_cls, layer_cls, attn_cls, mlp_cls, norm_cls = SUPPORTED[config.model_type]
    if not _own_forward(model, model_cls):
        return f"not transformers' {model_cls.__name__} (a subclass, or a patched forward)"
    layers = list(inner.layers)
    if len(layers) != config.num_hidden_layers or not layers:
        return "layer count differs from the config"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (_own_forward(layer, layer_cls) and _own_forward(attn, attn_cls) and _own_forward(mlp, mlp_cls)):
            return f"layer, attention or MLP of another class than {config.model_type}'s (or a patched forward)"
        if not (_own_forward(layer.input_layernorm, norm_cls) and _own_forward(layer.post_attention_layernorm, norm_cls)):
            return "norms other than the Llama RMS norm"
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if not all(_plain_linear(m) for m in linears):
            return "projections other than plain nn.Linear on the CPU (LoRA, quantised, sharded, hooked)"
        if any(m.bias is not None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "MLP biases"
        if len({m.bias is None for m in (attn.q_proj, attn.k_proj, attn.v_proj)}) > 1:
            return "biases on some of the q/k/v projections but not all"
    if not _own_forward(inner.norm, norm_cls) or not _plain_linear(model.lm_head) or model.lm_head.bias is not None:
        return "final norm or LM head of another kind"
    if type(inner.embed_tokens) is not torch.nn.Embedding:
        return "embedding of another kind"
    if _hooked(model):
        return "forward hooks registered (they expect transformers' modules to run)"
    return None


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMS norm ``w · (x / sqrt(mean(x²) + eps))`` in fp32, cast back to ``h``'s dtype before ``w``.

    Operation for operation as transformers' ``LlamaRMSNorm``; for fp32 ``h`` and ``w`` torch's one-call
    ``F.rms_norm`` instead (the same value bit for bit, ``tests/models/test_fused_decode.py``; ~3 % faster inside a
    decode step on a Cascade Lake Xeon, docs/performance.md)."""
    if h.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(h, (h.shape[-1],), weight, eps)
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``[-sin₁, sin₂]`` from ``rotary_emb``'s ``sin`` ``(..., D)``: the table :func:`_rotate` takes, made once per pass."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x·cos + rotate_half(x)·sin`` on ``(..., heads, D)``, in the promoted dtype of ``x`` and ``cos``.

    ``cos`` and ``sin_signed`` (:func:`signed_sin`) broadcast against ``x`` (``(B | 1, 1, D)`` for ``(B, heads,
    D)``). ``rotate_half(x)·sin = [-x₂·sin₁, x₁·sin₂] = swap(x)·[-sin₁, sin₂]`` with ``swap(x) = [x₂, x₁]``, so each half
    gets the same products and sums as transformers' ``apply_rotary_pos_emb`` (``-(a·b)`` is ``a·(-b)`` and ``a + (-b)``
    is ``a - b`` exactly): four ops, no concatenation. A bf16 ``x`` with fp32 tables (autocast) is promoted exactly to
    fp32 by the products, as transformers upcasts it; any memory layout of ``x`` works (the products make new tensors).
    """
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # (..., heads, D): [x₂, x₁]
    return x * cos + swapped * sin_signed


def compute_dtype(model) -> torch.dtype:
    """The dtype the fused passes compute in: autocast's on the CPU when it is on, else the LM head's."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else model.lm_head.weight.dtype


def mlp_residual(h: torch.Tensor, w: "_LayerWeights", dtype: torch.dtype) -> torch.Tensor:
    """``h + down(silu(gate(x)) · up(x))`` with ``x`` the post-attention RMS norm of the residual ``h`` ``(..., C)``."""
    gate_up = w.gate_up(_rms_norm(h, w.norm_post, w.eps_post).to(dtype))  # (..., 2·I)
    inter = gate_up.shape[-1] // 2
    return h + w.down(F.silu(gate_up[..., :inter]) * gate_up[..., inter:])  # (..., C)


def head_logits(h: torch.Tensor, weights: "FusedWeights") -> torch.Tensor:
    """The LM head on the final RMS norm of ``h`` ``(..., C)``: ``(..., V)`` in the weights' dtype."""
    return weights.head(_rms_norm(h, weights.norm, weights.norm_eps).to(weights.dtype))


def decode_step(model, weights: FusedWeights, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, cache, prefix: SharedPrefix | None = None,
                native=None) -> torch.Tensor:
    """Logits ``(B, 1, V)`` for one new token per row, appending its keys and values to ``cache``.

    ``input_ids`` ``(B, 1)``; ``attention_mask`` ``(B, L + 1)`` (1 = real, 0 = padding) or None; ``cache``
    holds ``L`` columns per layer. Positions default to ``L`` for every row, as transformers' Llama.
    With ``prefix`` (rows in groups sharing their first cache columns) attention reads those once per group.
    With ``native`` (:func:`ragen.models.native.ops`) a grouped step that :func:`ragen.models.native_decode.can_run`
    takes runs its layers and head in C++ (``prefix.native_steps`` counts those).
    """
    inner, config = model.model, model.config
    B = input_ids.shape[0]
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    g, q_width, kv_width = H // H_kv, H * D, H_kv * D
    scaling = D ** -0.5
    dtype = weights.dtype
    past = cache.get_seq_length()
    with torch.autocast("cpu", enabled=False):
        h = inner.embed_tokens(input_ids)  # (B, 1, C), the residual stream's dtype
        if position_ids is None:
            position_ids = torch.full((1, 1), past, dtype=torch.long, device=input_ids.device)
        cos, sin = inner.rotary_emb(h, position_ids=position_ids)  # (B | 1, 1, D)
        sin = signed_sin(sin)  # [-sin₁, sin₂], as _rotate takes it
        h = h[:, 0]  # (B, C)
        padding = None
        if attention_mask is not None and not bool(attention_mask.all()):
            padding = (attention_mask == 0)[:, None, None, :]  # (B, 1, 1, L + 1): columns no query may read
        grouped = prefix is not None and prefix.grouped_step(past, padding)
        if grouped and native is not None and native_decode.can_run(weights, cache, prefix, model):
            logits = native_decode.grouped_step(native, model, weights, h, cos, sin, cache, prefix, past)
            if logits is not None:  # None: the kernel refused the step, which runs below
                prefix.native_steps += 1
                return logits.unsqueeze(1)
        for i, w in enumerate(weights.layers):
            x = _rms_norm(h, w.norm_in, w.eps_in).to(dtype)  # (B, C)
            qkv = w.qkv(x)  # (B, H·D + 2·H_kv·D)
            qk = qkv[:, : q_width + kv_width].reshape(B, H + H_kv, D)  # a view (row- or column-major output)
            qk = _rotate(qk, cos, sin)  # (B, H + H_kv, D) in cos's dtype: query and key heads, rotated together
            key = qk[:, H:].unsqueeze(2)  # (B, H_kv, 1, D)
            value = qkv[:, q_width + kv_width :].view(B, H_kv, 1, D)
            if grouped and type(cache.layers[i]) is GrowingLayer:
                cache.layers[i].write(key, value)  # the grouped step reads its columns from prefix: a deferred row copy stays so
                keys = values = None
            else:
                keys, values = cache.update(key, value, i)  # (B, H_kv, L + 1, D)
            query = qk[:, :H].reshape(B, H_kv, g, D).float()  # (B, H_kv, g, D): a KV head's query heads together
            if prefix is None:
                attended = grouped_one_query(query, keys, values, scaling, padding)  # (B, H_kv, g, D)
            elif grouped:
                attended = _attend_grouped(query, key, value, scaling, prefix, i)
            else:
                attended = _attend_shared(query, keys, values, padding, scaling, prefix, i)
            attended = attended.reshape(B, q_width).to(qk.dtype).to(dtype)  # (B, H·D)
            h = mlp_residual(h + w.o(attended), w, dtype)  # (B, C)
        if grouped:
            prefix.own_steps += 1
        return head_logits(h, weights).unsqueeze(1)  # (B, 1, V)


def _cache_fits(cache, attention_mask) -> bool:
    # exact types: sliding-window, quantised, ... layers (DynamicLayer subclasses) keep other columns
    if not plain_layers(cache) or not all(layer.is_initialized for layer in cache.layers):
        return False
    past = cache.get_seq_length()
    return past > 0 and (attention_mask is None or (attention_mask.dim() == 2 and attention_mask.shape[1] == past + 1))


class FusedDecoder:
    """Holds one model's :class:`FusedWeights` between calls of one rollout session; :meth:`clear` drops them."""

    def __init__(self, pack: bool = True):
        self.weights: FusedWeights | None = None
        #: The casts that only feed oneDNN's reorder (:class:`PackedLinear` keeps its packed copy, not its input) go
        #: through this one buffer, kept between sessions: ~270 MB of fresh pages a rollout for SmolLM2-135M otherwise,
        #: as the weights change between rollouts (``benchmarks/bench_decode.py``). It grows to the largest packed weight (the LM head, 54 MiB). None casts each weight into a new tensor.
        self.staging: KeptBuffer | None = KeptBuffer()
        #: True packs for oneDNN (:mod:`ragen.models.packed_linear`) what was measured to win: every bf16 projection,
        #: the fp32 LM head; False keeps plain tensors; a set of :data:`PROJECTIONS` packs those (in any dtype).
        self.pack = pack
        #: fp32 projections packed for MKL at the decode batch: None = what ``pack=True`` measured to win
        #: (:data:`FP32_MKL_PROJECTIONS`, none unless ``pack`` is True); a set of :data:`PROJECTIONS` names those.
        self.mkl: frozenset[str] | None = None
        #: The running call's ``max_new_tokens``, set by ``HFBackend`` (None: unknown, MKL packs at the first step).
        self.call_new_tokens: int | None = None
        #: With a shared prefix, also read the rows' own columns per group (:func:`_attend_grouped`).
        self.group_own_columns = True
        #: Set for one ``generate`` call whose rows share prompts (``HFBackend._shared_prefill``/``_common_prefill``).
        self.prefix: SharedPrefix | None = None
        #: Where :attr:`prefix`'s fp32 copies go (:meth:`SharedPrefix.from_layers`' ``pages``), kept for a session: a
        #: multi-turn rollout's resumed turns copy their whole caches there each call (~2.5 GB for 64 Sokoban rows by
        #: turn 5, from the cache's shape); on fresh pages that copy took ~2.2 s a call on this project's VM, the same
        #: copy on reused memory ~0.14 s (``benchmarks/bench_multiturn.py``).
        self.prefix_pages: list[KeptBuffer] = []
        #: Decode steps taken by :func:`decode_step` (of them, with a shared prefix) and handed to transformers.
        self.fused_steps = 0
        self.shared_prefix_steps = 0
        #: Of the shared-prefix steps, those that also read the rows' own columns per group (:func:`_attend_grouped`).
        self.grouped_steps = 0
        #: Use ragen's C++ kernels where they build: bf16 grouped steps through :mod:`ragen.models.native_decode`, fp32
        #: projections' decode-sized calls through the panel GEMM (:class:`ragen.models.packed_linear.PackedLinear`).
        self.native = True
        #: Of the grouped steps, those the C++ kernel computed.
        self.native_steps = 0
        self.plain_calls = 0
        #: Prompt prefills run through these weights (:func:`ragen.models.fused_prefill.prefill`, by ``HFBackend``).
        self.prefill_calls = 0
        #: Seconds spent building :class:`FusedWeights` (casts, oneDNN packs) and packing them for MKL at a row count:
        #: once per session, within whichever prefill or decode step first needs them (``HFBackend`` reports it apart).
        self.build_s = 0.0

    def prefix_for(self, batch: int, past: int) -> SharedPrefix | None:
        """The recorded shared prefix if it describes this call's rows (``batch`` rows, ``past`` cached columns)."""
        p = self.prefix
        if p is None or batch != p.group * p.values[0].shape[0] or past < p.length:
            return None
        return p

    def weights_for(self, model, dtype: torch.dtype) -> FusedWeights:
        if self.weights is None or not self.weights.current(model, dtype):
            self.weights = None  # free the old copy before building the new one
            start = time.perf_counter()
            self.weights = FusedWeights(model, dtype, pack=self.pack, staging=self.staging, mkl=self.mkl,
                                        panel=self.native)
            self.build_s += time.perf_counter() - start
        return self.weights

    def pack_rows_if_it_pays(self, weights: FusedWeights, rows: int, call_steps: int) -> None:
        """Pack ``weights``' MKL-backed linears at ``rows`` rows if the running call (``call_steps`` steps taken) may
        still generate :data:`MKL_PACK_MIN_STEPS` tokens, or its length is unknown.

        The pack is a copy for one row count: later calls of the session at other row counts run the plain weights,
        and both copies are valid only while the parameters stay unchanged (the session's scope, :meth:`clear`)."""
        left = None if self.call_new_tokens is None else self.call_new_tokens - call_steps
        if left is None or left >= MKL_PACK_MIN_STEPS:
            start = time.perf_counter()
            weights.pack_rows(rows)
            self.build_s += time.perf_counter() - start

    def native_ops(self, dtype: torch.dtype):
        """The C++ kernels for a step computed in ``dtype`` (bf16 only), or None: off, or not built on this machine."""
        return native.ops() if self.native and dtype == torch.bfloat16 else None

    def clear(self) -> None:
        """Drop the weights and the prefix pages (the staging buffer stays: the next rollout's casts reuse its pages)."""
        self.weights = None
        self.prefix_pages = []


@contextlib.contextmanager
def fused_decode_for(model, decoder: FusedDecoder, enabled: bool = True):
    """Within the block, ``model``'s one-token decode calls run :func:`decode_step`; yields whether it is switched.

    The switch replaces the instance's ``forward`` (transformers' ``generate`` calls the module, which
    calls ``forward``); calls it cannot take exactly go to the class's ``forward`` unchanged. Restored on
    exit, also on error.
    """
    switch = enabled and unsupported_reason(model) is None
    if not switch:
        yield False
        return
    plain = model.forward
    own = vars(model).get("forward")  # an instance forward set before this block, restored on exit
    weights = None  # fetched at the first step: parameters cannot change within the block
    call_steps = 0

    def forward(input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        cache = kwargs.get(CACHE_KWARG)
        extra = {k: v for k, v in kwargs.items() if k not in IGNORED_KWARGS}
        if (input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1 or inputs_embeds is not None
                or labels is not None or use_cache is False or torch.is_grad_enabled() or model.training
                or any(v not in (None, False) for v in extra.values()) or not _cache_fits(cache, attention_mask)
                or (position_ids is not None and position_ids.shape[-1] != 1)):
            decoder.plain_calls += 1
            return plain(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                         logits_to_keep=logits_to_keep, **kwargs)
        nonlocal weights, call_steps
        dtype = compute_dtype(model)
        if weights is None or weights.dtype != dtype:
            weights = decoder.weights_for(model, dtype)
        if weights.rows_pending:
            decoder.pack_rows_if_it_pays(weights, input_ids.shape[0], call_steps)
        prefix = decoder.prefix_for(input_ids.shape[0], cache.get_seq_length())
        kept = prefix.own_steps if prefix is not None else None
        natively = prefix.native_steps if prefix is not None else 0
        logits = decode_step(model, weights, input_ids, attention_mask, position_ids, cache, prefix,
                             native=decoder.native_ops(dtype) if prefix is not None else None)
        call_steps += 1
        decoder.fused_steps += 1
        decoder.shared_prefix_steps += prefix is not None
        decoder.grouped_steps += kept is not None and prefix.own_steps == kept + 1
        decoder.native_steps += prefix is not None and prefix.native_steps - natively
        return CausalLMOutputWithPast(logits=logits, **{CACHE_KWARG: cache})

    model.forward = forward
    try:
        yield True
    finally:
        if own is not None:
            model.forward = own
        else:
            del model.forward
