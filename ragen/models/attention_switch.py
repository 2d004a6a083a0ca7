"""Scoped switches of a model's attention implementation to one of ragen's CPU attention paths.

:mod:`ragen.models.decode_attention` (generation) and :mod:`ragen.models.train_attention` (update and
scoring passes) each register a transformers attention function under a name of their own that computes
some calls itself and hands the rest to transformers' ``sdpa`` (both built by :func:`with_sdpa_fallback`).
:func:`attention_switch` sets that name in the model's config for a ``with`` block -- transformers reads
it at every call -- and restores ``"sdpa"`` on exit, even on error.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

from ragen.models.device import model_device
from ragen.models.lora import base_model

#: Keyword arguments of an attention call that do not change its result (anything else goes to ``sdpa``).
HARMLESS_KWARGS = {"position_ids", "cache_position", "output_attentions", "use_cache", "past_key_values",
                   "position_embeddings", "sliding_window"}


def harmless(kwargs: dict) -> bool:
    """True if every extra keyword argument is known not to change the result, or unset."""
    return all(k in HARMLESS_KWARGS or v is None or v is False for k, v in kwargs.items())


def with_sdpa_fallback(fits: Callable, compute: Callable, doc: str = "") -> Callable:
    """A transformers attention function: ``compute(query, key, value, attention_mask, scale)`` for the calls
    ``fits(query, key, value, attention_mask, dropout, kwargs)`` accepts (it must compute what ``sdpa`` would
    there), transformers' ``sdpa`` for every other call, unchanged."""

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs):
        if not fits(query, key, value, attention_mask, dropout, kwargs):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          is_causal=is_causal, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return compute(query, key, value, attention_mask, scale), None

    attention.__doc__ = doc or attention.__doc__
    return attention


def register(name: str, attention: Callable) -> None:
    """Register ``attention`` under ``name`` with transformers, with the masks ``sdpa`` gets."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is sdpa_mask


def supports_attention_backend(model) -> bool:
    """Whether the model's attention layers call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.

    transformers' ``_supports_attention_backend`` class flag. Models without it (Falcon, say) test the
    name ``"sdpa"`` themselves and would take another branch under any other name.
    """
    return bool(getattr(type(base_model(model)), "_supports_attention_backend", False))


@contextlib.contextmanager
def attention_switch(model, name: str, enabled: bool = True):
    """Within the block, a CPU model that uses ``sdpa`` attends with the function registered as ``name``; yields whether it does.

    Left alone: models on another implementation (eager, flash, flex) or device, models whose attention
    does not read transformers' registry, and composite configs -- transformers' setter writes the name
    into every sub-config, and restoring ``"sdpa"`` would overwrite a sub-model's own choice (a vision
    tower on "eager", say).
    """
    config = model.config
    switch = enabled and getattr(config, "_attn_implementation", None) == "sdpa" and model_device(model).type == "cpu" \
        and not getattr(config, "sub_configs", None) and supports_attention_backend(model)
    if switch:
        config._attn_implementation = name
    try:
        yield switch
    finally:
        if switch:
            config._attn_implementation = "sdpa"
