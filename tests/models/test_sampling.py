"""Inverse-transform sampling: the distribution ``generate(do_sample=True)`` samples from, drawn with one uniform per row."""

import math

import pytest
import torch

from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.sampling import InverseCDFSampler


def draw(sampler: InverseCDFSampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    """Token counts over ``n`` rows that all carry ``logits`` (V,)."""
    out = sampler(torch.zeros((n, 1), dtype=torch.long), logits.expand(n, -1).clone())  # (n, V)
    assert torch.equal((out == 0).sum(-1), torch.ones(n, dtype=torch.long))  # exactly one token per row
    assert torch.isinf(out).sum() == n * (logits.numel() - 1)
    return torch.bincount(out.argmax(-1), minlength=logits.numel())


def assert_frequencies(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Every count within 5 standard deviations of n·p (binomial), and zero wherever p is zero."""
    n = counts.sum().item()
    for c, p in zip(counts.tolist(), probs.tolist()):
        if p == 0:
            assert c == 0
        else:
            assert abs(c - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, (counts, probs)


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_frequencies_follow_the_tempered_softmax(temperature):
    torch.manual_seed(0)
    counts = draw(InverseCDFSampler(temperature), LOGITS, 40_000)
    assert_frequencies(counts, torch.softmax(LOGITS / temperature, -1))


def test_top_k_and_top_p_keep_transformers_semantics():
    torch.manual_seed(1)
    p = torch.softmax(LOGITS, -1)
    top2 = torch.where(torch.arange(6) < 2, p, torch.zeros(6))
    assert_frequencies(draw(InverseCDFSampler(top_k=2), LOGITS, 40_000), top2 / top2.sum())
    # top_p=0.8: the smallest head whose mass reaches 0.8 (p = .52, .19, .12, .07, ...: first three tokens)
    head = torch.where(torch.arange(6) < 3, p, torch.zeros(6))
    assert p[:2].sum() < 0.8 <= p[:3].sum()
    assert_frequencies(draw(InverseCDFSampler(top_p=0.8), LOGITS, 40_000), head / head.sum())


def test_a_single_allowed_token_is_always_drawn():
    only = torch.full((6,), float("-inf"))
    only[4] = 0.0
    assert draw(InverseCDFSampler(), only, 1000).tolist() == [0, 0, 0, 0, 1000, 0]


@pytest.mark.parametrize("sampler", HFBackend.SAMPLERS)
def test_backend_first_tokens_follow_the_models_distribution(sampler):
    """Through ``generate``: the first sampled token of 4,000 rows matches softmax(top-5 logits / T) of the model."""
    model, tokenizer = load_model("tiny")
    prompt = tokenizer("Which arm do you pull?")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()  # (V,)
    top = torch.topk(logits, 5)
    expected = torch.zeros_like(logits).scatter_(0, top.indices, torch.softmax(top.values / 0.7, -1))
    backend = HFBackend(model, tokenizer, precision="fp32", batch_size=4000, reuse_kv=False, sampler=sampler)
    torch.manual_seed(2)
    gens = backend.generate([prompt] * 4000, SamplingParams(max_new_tokens=1, temperature=0.7, top_k=5))
    counts = torch.bincount(torch.tensor([g.token_ids[0] for g in gens]), minlength=logits.numel())
    assert_frequencies(counts[top.indices], expected[top.indices])
    assert counts.sum() == counts[top.indices].sum()  # nothing outside the top 5


def test_unknown_sampler_is_refused():
    model, tokenizer = load_model("tiny")
    with pytest.raises(ValueError, match="sampler"):
        HFBackend(model, tokenizer, sampler="gumbel")
