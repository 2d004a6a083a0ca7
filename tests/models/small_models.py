"""Small random decoder models (llama, with biases, qwen2, mistral) for the model tests (not a test module)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

SMALL = dict(vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)


def small_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL))
    elif kind == "llama_bias":  # biases on q/k/v and o
        model = LlamaForCausalLM(LlamaConfig(**SMALL, attention_bias=True))
    elif kind == "qwen2":  # biases on q/k/v only
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None))
    else:
        raise ValueError(kind)
    for p in model.parameters():  # biases start at zero: give them values so they count
        if p.dim() == 1 and not p.any():
            p.data.normal_(0, 0.1)
    return model.eval()
