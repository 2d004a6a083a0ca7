"""Activation ("gradient") checkpointing: keep each decoder layer's input, recompute the layer in backward.

Without it the backward pass needs every intermediate the forward pass made: for SmolLM2-135M
under bf16 autocast about 1 GB of saved tensors per 1 100-token conversation (30 layers × ~30 KB
per token and layer: fp32 residual-stream and norm outputs, bf16 casts of each linear's input, the
MLP's 1 536-wide intermediates), which is what makes twenty-turn FrozenLake chats cost 17–20 GB at
four chats per micro-batch. With checkpointing only the layer inputs stay (``L × T × H`` fp32,
76 MB for that chat) and each layer's forward runs once more during the backward pass: about one
extra forward, i.e. ~1/3 more compute for a full update (docs/performance.md, "Memory").

This is transformers' own mechanism (``GradientCheckpointingLayer`` with torch's non-reentrant
``torch.utils.checkpoint``); this module only switches it on for a plain or peft-wrapped model.
It acts only in training mode with gradients enabled, so generation, scoring and evaluation are
untouched. A checkpointed layer cannot write a KV cache (the recompute would write it twice), so
callers must not combine it with the shared-prompt cache of :func:`ragen.train.logprobs.decoder_hidden`.
"""

from __future__ import annotations

from ragen.models.lora import base_model


def enable_checkpointing(model) -> None:
    """Checkpoint every decoder layer of ``model`` (non-reentrant; results equal up to float rounding)."""
    base = base_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(base).__name__} does not support activation checkpointing")
    kwargs = {"use_reentrant": False}  # works with frozen inputs (LoRA, trainable_layers) without input grads
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

