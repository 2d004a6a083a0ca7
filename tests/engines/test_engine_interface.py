"""The generation engine interface: one light module the agent depends on, one factory that says which engine runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ragen.config import load_config
from ragen.engines import GenerationEngine, SamplingParams, build_engine
from ragen.engines.factory import describe_hf


def test_the_agent_package_imports_neither_torch_nor_the_models():
    code = ("import sys, ragen.agent, ragen.engines.base; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('ragen.models')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_the_factory_builds_the_transformers_engines_and_says_why(tiny):
    model, tokenizer = tiny
    lines: list[str] = []
    engine = build_engine(model, tokenizer, load_config("bandit", ["model=tiny"]), say=lines.append)
    assert isinstance(engine, GenerationEngine)
    assert lines == ["[ragen] generation engine: cpu: the CPU fast path (fused llama decode step; C++ kernels on)"]
    plain = load_config("bandit", ["model=tiny", "rollout.fast_decode=false"])
    assert describe_hf(model, plain) == "hf: transformers generate (rollout.fast_decode=false)"
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, do_sample=False))
    assert len(out) == 1 and 1 <= len(out[0].token_ids) <= 3


def test_engine_hf_is_plain_transformers_and_cpu_the_fast_path_with_the_same_greedy_tokens(tiny):
    model, tokenizer = tiny
    built, lines = {}, []
    for name in ("hf", "cpu"):
        config = load_config("bandit", ["model=tiny", f"rollout.engine={name}", "trainer.precision=fp32"])
        built[name] = build_engine(model, tokenizer, config, say=lines.append)
    assert lines == ["[ragen] generation engine: hf: transformers generate (rollout.engine=hf)",
                     "[ragen] generation engine: cpu: the CPU fast path (fused llama decode step; C++ kernels on)"]
    assert not built["hf"].fused_decode and not built["hf"].decode_loop
    assert built["cpu"].fused_decode and built["cpu"].decode_loop
    prompts = [[1, 2, 3, 4], [5, 6, 7], [5, 6, 7]]
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    tokens = {name: [g.token_ids for g in engine.generate(prompts, params)] for name, engine in built.items()}
    assert tokens["hf"] == tokens["cpu"]


def test_an_unknown_engine_is_a_config_error_naming_the_choices():
    from ragen.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.engine.*auto, hf, cpu, vllm"):
        load_config("bandit", ["model=tiny", "rollout.engine=gpu"])


def test_an_architecture_the_fast_path_does_not_take_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    why = describe_hf(model, load_config("bandit", ["model=tiny"]))
    assert why.startswith("cpu: transformers generate with ragen's KV cache and sampling loop (the fused decode step "
                          "does not take this model: ")
