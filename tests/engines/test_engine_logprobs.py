"""Every engine reports, for the ids it sampled, the log-probabilities a plain transformers forward pass gives those
ids (``log softmax(logits / T)`` at each sampled token): on every architecture of the tiny-model list, through the
CPU fast path and through plain ``generate``, in fp32 (≤ 1e-4) and bf16 (≤ 2e-2)."""

from __future__ import annotations

import pytest
import torch

from ragen.config import load_config
from ragen.engines import SamplingParams, build_engine
from ragen.models import autocast, load_model
from tests.models.test_architectures import ARCHITECTURES, build

TEMPERATURE = 0.7
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny")[1]


def plain_logprobs(model, prompt: list[int], sampled: list[int], precision: str) -> torch.Tensor:
    """``(N,)``: log π(sampled[k] | prompt + sampled[:k]) from one forward pass of the whole row."""
    ids = torch.tensor([prompt + sampled])  # (1, P + N)
    with torch.no_grad(), autocast(precision, "cpu"):
        logits = model(input_ids=ids).logits[0].float()  # (P + N, V)
    steps = logits[len(prompt) - 1 : -1] / TEMPERATURE  # (N, V): the positions that predict the sampled ids
    return torch.log_softmax(steps, -1).gather(1, torch.tensor(sampled)[:, None]).squeeze(1)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "plain_generate"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_sampled_logprobs_equal_a_plain_forward(arch, fast, precision, tokenizer, tmp_path):
    if precision == "bf16" and arch not in ("llama", "gpt2", "gemma2"):
        pytest.skip("bf16 is checked on one fast-path and two other layouts: the rest repeat fp32's case")
    model, tok = load_model(build(arch, tokenizer, tmp_path / "model"))
    config = load_config("bandit", [f"model={tmp_path / 'model'}", f"trainer.precision={precision}",
                                    f"rollout.fast_decode={str(fast).lower()}"])
    engine = build_engine(model, tok, config)
    prompts = [tok.encode("Which arm do you pull?"), tok.encode("The arms are Teacher and Pirate. Answer:"), [5, 9]]
    torch.manual_seed(0)
    generations = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=TEMPERATURE))
    for prompt, generation in zip(prompts, generations):
        assert generation.logprobs is not None and len(generation.logprobs) == len(generation.token_ids) > 0
        expected = plain_logprobs(model, prompt, generation.token_ids, precision)
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=TOLERANCE[precision], rtol=0), arch


def test_greedy_decoding_reports_no_logprobs(tokenizer, tmp_path):
    model, tok = load_model("tiny")
    engine = build_engine(model, tok, load_config("bandit", ["model=tiny", "trainer.precision=fp32"]))
    [generation] = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, do_sample=False))
    assert generation.logprobs is None
