"""Activation ("gradient") checkpointing: keep each decoder layer's input, recompute the layer in backward.

Without it the backward pass needs every intermediate the forward pass made: for SmolLM2-135M
under bf16 autocast about 1 GB of saved tensors per 1 100-token conversation (30 layers × ~30 KB
per token and layer: fp32 residual-stream and norm outputs, bf16 casts of each linear's input, the
MLP's 1 536-wide intermediates), which is what makes twenty-turn FrozenLake chats cost 17–24 GB at
four chats per micro-batch. With checkpointing only the layer inputs stay (``L × T × H`` fp32,
76 MB for that chat) and each layer's forward runs once more during the backward pass: about one
extra forward, i.e. ~1/3 more compute for a full update (benchmarks/bench_memory.py
--preset frozenlake_slippery_study).

This is transformers' own mechanism (``GradientCheckpointingLayer`` with torch's non-reentrant
``torch.utils.checkpoint``); this module only switches it on for a plain or peft-wrapped model.
It acts in training mode (recent 5.x releases also require gradients to be on; 5.0 does not, and
then drops the KV cache of a ``generate`` call made in training mode). ragen generates, scores and
evaluates in eval mode, where no release checkpoints. A checkpointed layer cannot write a KV cache
(the recompute would write it twice), so :func:`ragen.train.logprobs.decoder_hidden` runs full rows
instead of its shared-prompt cache when checkpointing is on in training mode.
"""

from __future__ import annotations

from ragen.models.freeze import decoder_layers
from ragen.models.lora import base_model


def enable_checkpointing(model) -> None:
    """Checkpoint every decoder layer of ``model`` (non-reentrant; results equal up to float rounding)."""
    base = base_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(base).__name__} does not support activation checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers also makes the embeddings' output require grad (a need of reentrant checkpointing
    # only). That would pull the backward pass, recompute included, through frozen bottom layers
    # (``optim.trainable_layers``), which ragen/models/freeze.py exists to skip.
    if getattr(base, "_require_grads_hook", None) is not None:
        base.disable_input_require_grads()


def disable_checkpointing(model) -> None:
    """Undo :func:`enable_checkpointing`: every decoder layer keeps its activations again."""
    base = base_model(model)
    if hasattr(base, "activation_checkpointing_disable"):
        base.activation_checkpointing_disable()
    elif getattr(base, "supports_gradient_checkpointing", False):
        base.gradient_checkpointing_disable()


def is_checkpointing(model) -> bool:
    """True if any decoder layer of ``model`` is set to checkpoint (the flag transformers sets on each).

    Asked on every training forward pass (:func:`ragen.train.logprobs.decoder_hidden`), so it reads
    the decoder's layer list rather than walking every module -- except for models whose layers are not
    in ``decoder.layers`` (GPT-2's ``h``, say), where it walks the modules."""
    try:
        layers = decoder_layers(model)
    except ValueError:
        layers = base_model(model).modules()
    return any(getattr(layer, "gradient_checkpointing", False) is True for layer in layers)
