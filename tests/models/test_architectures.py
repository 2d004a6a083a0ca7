"""Any Hugging Face causal LM trains through the plain path: tiny random models of ten architectures, built here
(nothing downloaded), each run 2 bandit steps with a full fine-tune and 1 Sokoban step with LoRA.

An entropy bonus keeps every update's gradient non-zero (the random models' answers all fail to parse, so their
rewards tie and the clipped loss alone would skip the backward pass): the backward runs through every architecture.
"""

from __future__ import annotations

import json

import pytest
import transformers

from ragen.cli import main
from ragen.models import load_model

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", SMALL),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", SMALL),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**SMALL, "head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", SMALL),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**SMALL, "head_dim": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**SMALL, "head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", SMALL),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, n_positions=1024)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**SMALL, "rotary_pct": 0.5}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", SMALL),
}
COMMON = ["trainer.total_steps=2", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
          "trainer.val_episodes=2", "trainer.progress_bar=false", "trainer.plot=false", "trainer.save_final=false",
          "algorithm.entropy_coeff=0.01"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny")[1]


def build(arch: str, tokenizer, path) -> str:
    config_name, model_name, sizes = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                                **sizes)
    getattr(transformers, model_name)(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_trains_full_and_with_lora(arch, tokenizer, tmp_path, capsys):
    model = build(arch, tokenizer, tmp_path / "model")
    assert main(["train", "bandit", f"model={model}", f"trainer.output_dir={tmp_path / 'full'}", *COMMON]) == 0
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "actor/grad_norm" in r]
    assert len(updates) == 2 and all(r["actor/grad_norm"] > 0 for r in updates)  # a real backward each step
    assert main(["train", "sokoban", f"model={model}", f"trainer.output_dir={tmp_path / 'lora'}", *COMMON,
                 "trainer.total_steps=1", "lora.rank=4"]) == 0
    assert "[ragen] generation engine: cpu" in capsys.readouterr().out
