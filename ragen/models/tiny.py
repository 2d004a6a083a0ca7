"""``tiny``: a randomly initialised Llama-architecture model for tests (a few M parameters).

It uses the embedded model's real tokenizer and chat template, so everything around the
model (chat rendering, masks, parsing, stop strings) is exercised exactly as with a real
model; only the weights are random (seeded, so runs are reproducible).
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ragen.models.embedded import embedded_tokenizer_dir

TINY_NAME = "tiny"


def tiny_config(vocab_size: int, bos_token_id: int, eos_token_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


def load_tiny(seed: int = 0):
    """Return ``(model, tokenizer)``; the same ``seed`` gives the same weights."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
    config = tiny_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    # the weights come from `seed`; every generator manual_seed touches (the CPU's and each visible GPU's) is put back,
    # so loading the model leaves the run's sampling streams where they were
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=gpus):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
