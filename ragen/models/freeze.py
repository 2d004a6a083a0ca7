"""Train only the top of the network: freeze the embeddings and all but the last ``n`` decoder layers.

Autograd then stops at the first trainable layer, so the backward pass (and the optimizer)
covers only the top ``n`` layers: for a long shared prompt and a short answer, as in the
bandit, the backward through the bottom layers' prompt positions is most of an update's cost.
The gradients of the parameters that do train are exact; the frozen ones simply do not move.
"""

from __future__ import annotations

import torch

from ragen.models.lora import base_model


#: Where transformers' causal LMs keep their blocks: ``layers`` (Llama, Qwen, Mistral, Gemma, Phi-3, GPT-NeoX,
#: OLMo, ...), ``h`` (GPT-2, GPT-J, Falcon, BLOOM), ``blocks``, ``layer``.
LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's list of transformer blocks (``model.model.layers`` for Llama-style models, ``transformer.h`` for
    GPT-2): the first of :data:`LAYER_LIST_NAMES` on the decoder that is a ``ModuleList``."""
    base = base_model(model)
    decoder = base.get_decoder()
    for name in LAYER_LIST_NAMES:
        layers = getattr(decoder, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"{type(base).__name__}: cannot find the decoder's layer list (decoder.{'/'.join(LAYER_LIST_NAMES)})")


def train_top_layers(model, n: int) -> list[str]:
    """Leave ``requires_grad`` on only in the last ``n`` decoder layers and the final norm; returns the frozen names.

    ``n <= 0`` or ``n >=`` the number of layers changes nothing (everything that trains keeps training).
    Under LoRA, call it after the adapters are added: only adapters in the top layers then train.
    """
    if n <= 0:
        return []
    layers = decoder_layers(model)
    if n >= len(layers):
        return []
    keep = {id(p) for layer in list(layers)[-n:] for p in layer.parameters()}
    base = base_model(model)
    decoder = base.get_decoder()
    norm = getattr(decoder, "norm", None) or getattr(decoder, "ln_f", None) or getattr(decoder, "final_layer_norm", None)
    if norm is not None and not hasattr(model, "get_base_model"):  # full fine-tune: the final norm trains too
        keep |= {id(p) for p in norm.parameters()}
    frozen = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in keep:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen
