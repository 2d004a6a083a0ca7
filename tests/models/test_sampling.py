"""Inverse-transform sampling: the distribution ``generate(do_sample=True)`` samples from, drawn with one uniform per row."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.sampling import BLOCK, InverseCDFSampler, inverse_cdf


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


def test_temperature_applies_before_top_p():
    """transformers' order: temper, then keep the smallest head of the tempered distribution reaching top_p."""
    torch.manual_seed(3)
    p = torch.softmax(LOGITS / 0.5, -1)  # ≈ .84, .11, .04, ...: the head reaching 0.9 is two tokens
    assert p[:1].sum() < 0.9 <= p[:2].sum()
    head = torch.where(torch.arange(6) < 2, p, torch.zeros(6))
    assert_frequencies(draw(InverseCDFSampler(temperature=0.5, top_p=0.9), LOGITS, 40_000), head / head.sum())


def test_frequencies_across_blocks_and_a_partial_tail_block():
    """A vocabulary of 2.5 blocks with the mass spread over all three (and zeros between)."""
    torch.manual_seed(4)
    V = 2 * BLOCK + BLOCK // 2
    logits = torch.full((V,), float("-inf"))
    picks = torch.tensor([0, 7, BLOCK - 1, BLOCK, BLOCK + 100, 2 * BLOCK + 3, V - 1])
    logits[picks] = torch.tensor([0.5, -1.0, 1.0, 0.0, -0.5, 2.0, 0.3])
    counts = draw(InverseCDFSampler(temperature=1.3), logits, 60_000)
    assert_frequencies(counts, torch.softmax(logits / 1.3, -1))


def reference_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The one-level definition: first i with F(i) ≥ u·F(V-1), F a float64 cumulative sum."""
    cdf = weights.double().cumsum(-1)  # (B, V)
    return torch.searchsorted(cdf, u * cdf[:, -1:])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3 * BLOCK + 17), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0, exclude_min=True),
       st.floats(0.0, 0.95), st.sampled_from([1, 17, BLOCK]))
def test_two_level_search_finds_the_one_level_token(V, seed, u, zero_share, block):
    """Same token as the float64 one-level search, unless the target lies within float32 rounding of a
    boundary of F; never a zero-weight token."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand((1, V), generator=g) ** 4 * torch.exp(8 * torch.randn((1, V), generator=g))  # (1, V) wide range
    weights[torch.rand((1, V), generator=g) < zero_share] = 0.0
    weights[0, torch.randint(V, (1,), generator=g)] = torch.rand((1,), generator=g) + 0.5  # at least one positive
    uu = torch.tensor([[u]], dtype=torch.float64)
    got = inverse_cdf(weights, uu, block=block).item()
    want = reference_inverse_cdf(weights, uu).item()
    assert weights[0, got] > 0
    if got != want:
        cdf = weights.double().cumsum(-1)[0]
        target = u * cdf[-1].item()
        boundary = cdf[min(got, want)].item()  # F between the two tokens: the target must sit on it
        assert abs(boundary - target) <= 1e-6 * cdf[-1].item(), (got, want)


def test_extreme_draws_pick_the_first_and_last_positive_tokens():
    weights = torch.zeros((2, 3 * BLOCK))
    weights[:, [5, BLOCK + 9, 3 * BLOCK - 40]] = torch.tensor([0.2, 0.5, 0.3])
    u = torch.tensor([[1e-300], [1.0]], dtype=torch.float64)
    assert inverse_cdf(weights, u).squeeze(1).tolist() == [5, 3 * BLOCK - 40]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_rows_without_a_distribution_are_refused(bad):
    """As torch.multinomial refuses them, instead of an index error or a silent last token."""
    logits = torch.zeros(3, 300)
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 7] = bad
    with pytest.raises(ValueError, match="not finite or sum to zero"):
        InverseCDFSampler()(torch.zeros((3, 1), dtype=torch.long), logits)


def test_the_scores_buffer_is_reused_between_steps_of_one_shape():
    """One (B, V) tensor per call shape, not a fresh one per decode step (the page-fault cost)."""
    sampler = InverseCDFSampler(temperature=0.8)
    ids = torch.zeros((4, 1), dtype=torch.long)
    first = sampler(ids, torch.randn(4, 300))
    second = sampler(ids, torch.randn(4, 300))
    assert second.data_ptr() == first.data_ptr()
    assert sampler(ids[:2], torch.randn(2, 300)).shape == (2, 300)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_drawn_distribution_is_the_tempered_softmax_with_eos_kept_out(temperature):
    """``probs`` (the weights ``draw`` samples from, made by the same code) is softmax(z / T) row by row, with the
    suppressed tokens at exactly 0 before ``min_new_tokens`` and back after: a golden check of the one-op softmax."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 700, generator=g) * 4
    logits[1, 5] = float("-inf")
    sampler = InverseCDFSampler(temperature, suppress=[7, 9], min_new_tokens=2)
    early = sampler.probs(torch.zeros((3, 4), dtype=torch.long), logits.clone())  # the call's first step
    expected = logits.double().clone()
    expected[:, [7, 9]] = float("-inf")
    torch.testing.assert_close(early, torch.softmax(expected / temperature, -1), rtol=1e-5, atol=1e-9)
    assert (early[:, [7, 9]] == 0).all() and early[1, 5] == 0
    later = sampler.probs(torch.zeros((3, 6), dtype=torch.long), logits.clone())  # 2 tokens written: EOS allowed
    torch.testing.assert_close(later, torch.softmax(logits.double() / temperature, -1), rtol=1e-5, atol=1e-9)


def test_a_single_allowed_token_is_always_drawn():
    only = torch.full((6,), float("-inf"))
    only[4] = 0.0
    assert draw(InverseCDFSampler(), only, 1000).tolist() == [0, 0, 0, 0, 1000, 0]


@pytest.mark.parametrize("sampler", HFBackend.SAMPLERS)
def test_backend_first_tokens_follow_the_models_distribution(sampler):
    """Through ``generate``: the first sampled token of 1,000 rows matches softmax(top-5 logits / T) of the model,
    on both samplers, even with min-p / typical-p in the model's own generation_config (ragen's SamplingParams alone
    shape the distribution: the trainer scores softmax(z / T); ragen/models/sampling.py, "Which distribution")."""
    model, tokenizer = load_model("tiny")
    model.generation_config.min_p, model.generation_config.typical_p = 0.75, 0.5
    prompt = tokenizer("Which arm do you pull?")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()  # (V,)
    top = torch.topk(logits, 5)
    expected = torch.zeros_like(logits).scatter_(0, top.indices, torch.softmax(top.values / 0.7, -1))
    # min_p=0.75, if applied, would cut these five's tail: here three of p = .25, .20, .19, .18, .18, each then drawn
    # 0 times where 1,000 rows expect ~180 +- 5 sigma = 61 (the 4,000 rows this test drew before cost ~4x the time)
    assert (expected[top.indices] < 0.75 * expected.max()).any()
    backend = HFBackend(model, tokenizer, precision="fp32", batch_size=1000, reuse_kv=False, sampler=sampler)
    torch.manual_seed(2)
    gens = backend.generate([prompt] * 1000, SamplingParams(max_new_tokens=1, temperature=0.7, top_k=5))
    counts = torch.bincount(torch.tensor([g.token_ids[0] for g in gens]), minlength=logits.numel())
    assert_frequencies(counts[top.indices], expected[top.indices])
    assert counts.sum() == counts[top.indices].sum()  # nothing outside the top 5


def test_unknown_sampler_is_refused():
    model, tokenizer = load_model("tiny")
    with pytest.raises(ValueError, match="sampler"):
        HFBackend(model, tokenizer, sampler="gumbel")
