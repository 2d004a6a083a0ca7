"""HFBackend: a group's shared prompt is prefilled once and its KV cache copied per row, with unchanged samples."""

import pytest
import torch

from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.prompt_prefill import Prefilled
from tests.models.prompts import prompts_with_groups, templated_prompts


@pytest.fixture(scope="module")
def backend():
    model, tokenizer = load_model("tiny")
    return HFBackend(model, tokenizer, precision="fp32")


@pytest.mark.parametrize("do_sample", [False, True])
def test_shared_prefill_gives_the_same_tokens_as_a_plain_prefill(backend, monkeypatch, do_sample):
    prompts = prompts_with_groups(backend.tokenizer)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, do_sample=do_sample)
    calls = []
    real = backend._shared_prefill
    monkeypatch.setattr(backend, "_shared_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    shared = backend.generate(prompts, params)
    assert calls  # the shared path really ran ...
    monkeypatch.setattr(backend, "_shared_prefill", lambda prompts, ids, mask, *a, **k: Prefilled(ids, mask, None))  # generate prefills
    torch.manual_seed(0)
    plain = backend.generate(prompts, params)
    assert [g.token_ids for g in shared] == [g.token_ids for g in plain]
    assert [g.finish_reason for g in shared] == [g.finish_reason for g in plain]
    assert all(len(g.token_ids) > 0 for g in shared)


def test_shared_prefill_caches_one_pass_per_distinct_prompt(backend):
    prompts = prompts_with_groups(backend.tokenizer)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), backend.pad_id)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    seen = []
    handle = backend.model.get_decoder().register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].shape),
                                                                with_kwargs=True)
    try:
        cache = backend._shared_prefill(prompts, ids, mask).cache
    finally:
        handle.remove()
    assert seen == [torch.Size([3, width - 1])]  # one row per distinct prompt, the last column left to generate
    assert cache.get_seq_length() == width - 1
    k0 = cache.layers[0].keys  # (B, heads, P-1, head_dim): rows of the same prompt hold the same cache
    assert k0.shape[0] == len(prompts)
    assert torch.equal(k0[0], k0[6]) and torch.equal(k0[3], k0[4]) and not torch.equal(k0[0], k0[3])
    seen.clear()
    handle = backend.model.get_decoder().register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].shape),
                                                                with_kwargs=True)
    try:  # all distinct: the same one pass per row that ``generate`` would make, done here so it is timed apart
        cache = backend._shared_prefill(prompts[:1] + prompts[3:4], ids[[0, 3]], mask[[0, 3]]).cache
    finally:
        handle.remove()
    assert seen == [torch.Size([2, width - 1])] and cache.get_seq_length() == width - 1


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("grouped", [True, False])
def test_common_prefix_prefill_gives_the_same_tokens_with_less_prefill(do_sample, grouped):
    model, tokenizer = load_model("tiny")
    prompts = templated_prompts(tokenizer, grouped)
    distinct = list(dict.fromkeys(map(tuple, prompts)))
    common = len(__import__("os").path.commonprefix(distinct))
    assert common >= HFBackend.min_common_prefix and common * (len(distinct) - 1) >= HFBackend.min_common_saved
    params = SamplingParams(max_new_tokens=8, temperature=1.0, do_sample=do_sample)
    runs = {}
    for on in (True, False):
        backend = HFBackend(model, tokenizer, precision="fp32", common_prefix=on)
        seen = []
        handle = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)),
                                                               with_kwargs=True)
        try:
            torch.manual_seed(0)
            runs[on] = backend.generate(prompts, params), backend.stats.prefilled_tokens, seen
            assert backend.stats.common_saved_tokens == (common * (len(distinct) - 1) if on else 0)
        finally:
            handle.remove()
    (shared, shared_tokens, shared_calls), (plain, plain_tokens, plain_calls) = runs[True], runs[False]
    assert [g.token_ids for g in shared] == [g.token_ids for g in plain]
    assert [g.finish_reason for g in shared] == [g.finish_reason for g in plain]
    assert plain_tokens - shared_tokens == common * (len(distinct) - 1)  # the common tokens ran once, not per prompt
    width = max(map(len, prompts))
    # one row for the common tokens, then each distinct prompt's rest (all but its last token) once
    assert shared_calls[:2] == [(1, common), (len(distinct), width - 1 - common)]
    assert plain_calls[0] == (len(distinct), width - 1)


def test_common_prefix_feeds_the_fused_steps_shared_prefix_and_skips_unrelated_prompts():
    model, tokenizer = load_model("tiny")
    backend = HFBackend(model, tokenizer, precision="fp32")
    params = SamplingParams(max_new_tokens=4, do_sample=False)
    backend.generate(templated_prompts(tokenizer), params)
    assert backend.fused.shared_prefix_steps == backend.fused.fused_steps > 0  # grouped rows: read once per group
    assert backend._common_prefill(prompts_with_groups(tokenizer)) is None  # nothing in common: left-padded prefill
    short = [tokenizer("System: a")["input_ids"], tokenizer("System: b")["input_ids"]]
    assert backend._common_prefill(short) is None  # too few common tokens to be worth a pass
    two = templated_prompts(tokenizer)[:3:2]  # two prompts: their common tokens once saves too little
    common = len(__import__("os").path.commonprefix([tuple(p) for p in two]))
    assert common >= HFBackend.min_common_prefix and common < HFBackend.min_common_saved
    assert backend._common_prefill(two) is None


PLAIN = dict(transposed_gemm=False, grow_cache=False, decode_attention=False, fused_decode=False, common_prefix=False,
             decode_loop=False, fused_prefill=False, first_from_prefill=False)


@pytest.mark.parametrize("fast", [True, False], ids=["ragen's loop", "generate"])
def test_a_stop_string_counts_only_in_what_the_model_wrote(fast):
    """A prompt ending inside a stop string used to end the row at its first token (transformers' stop-string check
    reads the prompt too), reported as a length or as a pad-token EOS the model never sampled."""
    model, tok = load_model("tiny", seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # spread-out weights: greedy answers that vary from token to token
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    backend = HFBackend(model, tok, precision="fp32", **({} if fast else PLAIN))
    prompt = tok("The arms are Apple and Stuntman. Choose one arm to pull, answer in tags.")["input_ids"]
    other = tok("Hi there friend")["input_ids"]
    free = backend.generate([prompt, other], SamplingParams(max_new_tokens=6, do_sample=False))
    assert len(free[0].token_ids) == 6
    stop = tok.decode(prompt[-1:] + free[0].token_ids[:1])  # begins in the prompt, completed by the first new token
    assert not tok.decode(free[0].token_ids).count(stop)
    for batch in ([prompt], [prompt, other]):
        got = backend.generate(batch, SamplingParams(max_new_tokens=6, do_sample=False, stop=(stop,)))
        assert got[0] == free[0]  # six tokens, finish "length", as without the stop string
