"""The generation engine interface: one light module the agent depends on, one factory that says which engine runs."""

from __future__ import annotations

import subprocess
import sys

from ragen.config import load_config
from ragen.engines import GenerationEngine, SamplingParams, build_engine
from ragen.engines.factory import describe_hf


def test_the_agent_package_imports_neither_torch_nor_the_models():
    code = ("import sys, ragen.agent, ragen.engines.base; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('ragen.models')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_the_factory_builds_the_hf_engine_and_says_why(tiny):
    model, tokenizer = tiny
    lines: list[str] = []
    engine = build_engine(model, tokenizer, load_config("bandit", ["model=tiny"]), say=lines.append)
    assert isinstance(engine, GenerationEngine)
    assert lines == ["[ragen] generation engine: hf: the CPU fast path (fused llama decode step; C++ kernels on)"]
    plain = load_config("bandit", ["model=tiny", "rollout.fast_decode=false"])
    assert describe_hf(model, plain) == "hf: transformers generate (rollout.fast_decode=false)"
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, do_sample=False))
    assert len(out) == 1 and 1 <= len(out[0].token_ids) <= 3


def test_an_architecture_the_fast_path_does_not_take_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    why = describe_hf(model, load_config("bandit", ["model=tiny"]))
    assert why.startswith("hf: transformers generate with ragen's KV cache and sampling loop (the fused decode step "
                          "does not take this model: ")
