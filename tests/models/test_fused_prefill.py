"""The fused prompt prefill leaves the KV cache transformers' prefill leaves, and the backend takes it where it may."""

import copy

import pytest
import torch
from transformers import DynamicCache

from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.cache_names import output_cache, with_cache
from ragen.models.fused_decode import decoder_stack
from ragen.models.fused_weights import FusedWeights
from ragen.models.fused_prefill import attention_mask_4d, prefill
from ragen.models.growing_cache import make_growing
from tests.models.small_models import SMALL, small_model

SMALL_VOCAB = SMALL["vocab_size"]


def layouts(seed: int = 0):
    """(name, ids, mask, positions, past): a left-padded prompt batch, an unpadded one, and a resumed cache's layout
    ``[kept | padding | rest]`` (the first ``past`` columns come from an earlier pass)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (3, 9), generator=g)
    padded = torch.ones(3, 9, dtype=torch.long)
    padded[1, :4] = 0
    padded[2, :8] = 0  # one real token: its padding queries see no real key
    resumed = torch.ones(3, 9, dtype=torch.long)
    resumed[0, 3:5] = 0  # padding between the kept part (columns 0-3) and the rest
    resumed[2, :2] = 0
    for name, mask, past in (("left-padded", padded, 0), ("unpadded", torch.ones_like(padded), 0), ("resumed", resumed, 4)):
        yield name, ids, mask, (mask.cumsum(1) - 1).clamp(min=0), past


def both(model, ids, mask, positions, past, weights, bf16=False, grow=False):
    """The caches after transformers' prefill and after :func:`prefill` of columns ``[past, W)`` (``[0, past)`` first
    by transformers in both)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        decoder = decoder_stack(model)
        start = DynamicCache(config=model.config)
        if past:
            start = output_cache(decoder(input_ids=ids[:, :past], attention_mask=mask[:, :past], position_ids=positions[:, :past],
                                         use_cache=True, **with_cache(start)))
        if grow:
            make_growing(start, ids.shape[1] + 2)
        theirs = output_cache(decoder(input_ids=ids[:, past:], attention_mask=mask, position_ids=positions[:, past:],
                                      use_cache=True, **with_cache(copy.deepcopy(start))))
        ours, logits = prefill(model, weights, ids[:, past:], mask, positions[:, past:],
                               copy.deepcopy(start) if past or grow else None)
        assert logits is None
    return theirs, ours


def real_columns(mask, cache):
    """Per layer, the keys and values of the real columns only (padding columns hold whatever: no query reads them)."""
    keep = mask.bool()
    return [(layer.keys.transpose(1, 2)[keep], layer.values.transpose(1, 2)[keep]) for layer in cache.layers]


@pytest.mark.parametrize("kind", ["llama", "llama_bias", "qwen2", "mistral"])
@pytest.mark.parametrize("pack", [False, True])  # plain fp32 weights, and oneDNN-packed fp32 copies
def test_fused_prefill_leaves_transformers_cache_in_fp32(kind, pack):
    model = small_model(kind)
    weights = FusedWeights(model, torch.float32, pack=frozenset({"qkv", "o", "gate_up", "down"}) if pack else False)
    for name, ids, mask, positions, past in layouts():
        theirs, ours = both(model, ids, mask, positions, past, weights, grow=name == "resumed")
        assert ours.get_seq_length() == theirs.get_seq_length() == ids.shape[1], name
        for (k1, v1), (k2, v2) in zip(real_columns(mask, theirs), real_columns(mask, ours)):
            assert k2.dtype == k1.dtype and v2.dtype == v1.dtype
            torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-5, msg=name)
        for layer in ours.layers:  # padding queries attended to themselves: nothing non-finite anywhere
            assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all(), name


def test_fused_prefill_under_bf16_autocast_is_as_close_to_fp32_as_transformers_bf16():
    model = small_model("llama", seed=3)
    weights = FusedWeights(model, torch.bfloat16)  # packed where oneDNN can
    for name, ids, mask, positions, past in layouts(seed=3):
        exact, _ = both(model, ids, mask, positions, past, FusedWeights(model, torch.float32, pack=False))
        theirs, ours = both(model, ids, mask, positions, past, weights, bf16=True)
        for (k0, v0), (k1, v1), (k2, v2) in zip(real_columns(mask, exact), real_columns(mask, theirs), real_columns(mask, ours)):
            assert (k2.dtype, v2.dtype) == (k1.dtype, v1.dtype) == (torch.float32, torch.bfloat16)  # transformers' dtypes
            for ref, plain, fused in ((k0, k1, k2), (v0.float(), v1.float(), v2.float())):
                plain_err, fused_err = (plain.float() - ref).abs(), (fused.float() - ref).abs()
                assert fused_err.max() <= 2 * plain_err.max() + 1e-3, (name, fused_err.max(), plain_err.max())


def test_mask_is_causal_and_padding_with_each_query_on_its_own_column():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1]])
    allowed = attention_mask_4d(mask, 3)[:, 0]  # queries are columns 3, 4, 5
    expected = torch.tensor([
        [[1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 1, 1]],  # column 3 is padding: itself only besides 0-1
        [[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]],
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)


@pytest.mark.parametrize("do_sample", [False, True])
def test_backend_prefills_through_the_fused_weights_and_samples_the_same_tokens(tiny, do_sample):
    model, tokenizer = tiny
    texts = ["go left", "the quick brown fox jumps", "a", "go left"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    params = SamplingParams(max_new_tokens=6, do_sample=do_sample, temperature=1.0)
    out = {}
    for fused_prefill in (True, False):
        backend = HFBackend(model, tokenizer, precision="fp32", fused_prefill=fused_prefill)
        torch.manual_seed(0)
        out[fused_prefill] = [g.token_ids for g in backend.generate(prompts, params)]
        assert (backend.fused.prefill_calls > 0) == fused_prefill
    assert out[True] == out[False]


def test_last_column_logits_equal_transformers_logits():
    """``prefill(last=True)``: the logits at each row's last column, as transformers' forward gives them (fp32), and in
    bf16 no further from fp32 than transformers' own bf16 forward."""
    model = small_model("llama", seed=5)
    for name, ids, mask, positions, past in layouts(seed=5):
        if past:
            continue  # (the resumed layout's logits come from the same code after its cache is filled)
        results = {}
        for bf16 in (False, True):
            weights = FusedWeights(model, torch.bfloat16 if bf16 else torch.float32, pack=True if bf16 else False)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                theirs = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits[:, -1]
                _, ours = prefill(model, weights, ids, mask, positions, last=True)
            assert ours.shape == theirs.shape == (ids.shape[0], SMALL_VOCAB) and ours.dtype == theirs.dtype
            results[bf16] = theirs.float(), ours.float()
        exact = results[False][0]
        torch.testing.assert_close(results[False][1], exact, rtol=1e-5, atol=1e-5, msg=name)
        plain_err, fused_err = (results[True][0] - exact).abs(), (results[True][1] - exact).abs()
        assert fused_err.max() <= 2 * plain_err.max() + 1e-3, (name, fused_err.max(), plain_err.max())


def test_backend_in_bf16_takes_every_lever_and_its_first_logits_are_as_close_to_fp32_as_a_decode_steps(tiny, monkeypatch):
    """The default path end to end under bf16 (packed weights through the staging buffer, fused prefill, shared prefix
    with grouped steps, first token from the prefill's logits), against fp32 logits of the same first step."""
    import ragen.models.backend as backend_module
    import ragen.models.fused_decode as fused_decode
    from ragen.models.packed_linear import packing_available
    from tests.models.prompts import templated_prompts

    model, tokenizer = tiny
    prompts = templated_prompts(tokenizer)  # a common prefix, rows in consecutive groups of a prompt
    params = SamplingParams(max_new_tokens=5, do_sample=False, min_new_tokens=5)
    first = {}  # the first logits each run samples from
    real_decode, real_step = backend_module.decode, fused_decode.decode_step

    def decode(*args, **kwargs):
        first.setdefault("prefill", kwargs["first_logits"])
        return real_decode(*args, **kwargs)

    def decode_step(*args, **kwargs):
        logits = real_step(*args, **kwargs)
        first.setdefault("step", logits)
        return logits

    monkeypatch.setattr(backend_module, "decode", decode)
    monkeypatch.setattr(fused_decode, "decode_step", decode_step)
    backend = HFBackend(model, tokenizer, precision="bf16")
    backend.generate(prompts, params)
    assert backend.fused.prefill_calls > 0 and backend.fused.grouped_steps > 0
    assert backend.fused.fused_steps == params.max_new_tokens - 1 and backend.stats.decode_fed_tokens == 0
    assert (backend.fused.staging.buffer is not None) == packing_available(torch.bfloat16)
    ours = first.pop("prefill")  # (B, V) bf16: the prefill's logits at each row's last prompt token
    monkeypatch.setattr(backend_module, "decode", real_decode)
    first.clear()
    HFBackend(model, tokenizer, precision="bf16", first_from_prefill=False).generate(prompts, params)
    step = first["step"][:, -1]  # (B, V): the first decode step's, which fed that token
    first.clear()
    HFBackend(model, tokenizer, precision="fp32", first_from_prefill=False).generate(prompts, params)
    exact = first["step"][:, -1].float()
    assert ours.dtype == step.dtype == torch.bfloat16
    ours_err, step_err = (ours.float() - exact).abs(), (step.float() - exact).abs()
    assert ours_err.max() <= 2 * step_err.max() + 1e-3, (ours_err.max(), step_err.max())


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("layout", ["common prefix", "left-padded", "grouped left-padded", "resumed turn"])
def test_first_token_from_the_prefills_logits_samples_what_a_first_decode_step_samples(tiny, do_sample, layout):
    """``first_from_prefill``: the prefill also runs each distinct prompt's last token and the loop samples the first
    token from those logits: one decode step fewer, the same tokens (fp32) as feeding that token in a decode step."""
    from tests.models.prompts import prompts_with_groups, templated_prompts

    model, tokenizer = tiny
    prompts = templated_prompts(tokenizer) if layout == "common prefix" else prompts_with_groups(tokenizer)
    if layout == "grouped left-padded":  # consecutive groups, no common prefix: _shared_prefill records a SharedPrefix
        prompts = [p for p in dict.fromkeys(map(tuple, prompts)) for _ in range(2)]
        prompts = [list(p) for p in prompts]
    params = SamplingParams(max_new_tokens=7, do_sample=do_sample, temperature=1.0, min_new_tokens=7)
    runs = {}
    for first in (True, False):
        backend = HFBackend(model, tokenizer, precision="fp32", first_from_prefill=first)
        torch.manual_seed(0)
        with backend.session():
            out = [g.token_ids for g in backend.generate(prompts, params)]
            steps, fed, saved = backend.fused.fused_steps, backend.stats.decode_fed_tokens, backend.stats.common_saved_tokens
            if layout == "resumed turn":  # turn 2 extends each row's turn 1: its kept cache is resumed
                turn2 = [p + g + tokenizer(" next")["input_ids"] for p, g in zip(prompts, out)]
                out = [g.token_ids for g in backend.generate(turn2, params)]
                assert backend.stats.reused_tokens > 0
                steps, fed = backend.fused.fused_steps - steps, backend.stats.decode_fed_tokens - fed
        runs[first] = out, steps, fed, backend.stats.prefilled_tokens
        assert (saved > 0) == (layout == "common prefix")  # each layout's own prefill path ran
        assert (backend.fused.grouped_steps > 0) == (layout in ("common prefix", "grouped left-padded"))
    (ours, steps, fed, prefilled), (theirs, plain_steps, plain_fed, plain_prefilled) = runs[True], runs[False]
    assert ours == theirs
    assert steps == plain_steps - 1 == params.max_new_tokens - 1  # the first token came from the prefill's logits
    assert fed == 0 and plain_fed == len(prompts)  # no row's last prompt token was fed by a decode step
    distinct = len({tuple(p) for p in prompts})
    assert layout == "resumed turn" or plain_prefilled - prefilled == len(prompts) - distinct  # once per distinct prompt


def test_one_new_token_comes_from_the_prefill_alone(tiny):
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in ("go left", "go left", "the quick brown fox")]
    params = SamplingParams(max_new_tokens=1, do_sample=False)
    out = {}
    for first in (True, False):
        backend = HFBackend(model, tokenizer, precision="fp32", first_from_prefill=first)
        out[first] = [g.token_ids for g in backend.generate(prompts, params)]
        assert backend.fused.fused_steps == (0 if first else 1)  # no decode step at all
    assert out[True] == out[False] and all(len(t) == 1 for t in out[True])


@pytest.mark.parametrize("pass_tokens", [3, 6, 12])  # 1, 2 and 4 columns a pass for 3 rows
def test_prefill_in_column_chunks_equals_one_pass(monkeypatch, pass_tokens):
    """Long prefills run in column chunks (:data:`~ragen.models.fused_prefill.PASS_TOKENS`): the same cache and last
    logits as one pass, including chunks whose queries are all padding in some rows."""
    import ragen.models.fused_prefill as fused_prefill

    model = small_model("qwen2", seed=6)
    weights = FusedWeights(model, torch.float32, pack=False)
    for name, ids, mask, positions, past in layouts(seed=6):
        with torch.no_grad():
            start = DynamicCache(config=model.config)
            if past:
                start = output_cache(decoder_stack(model)(input_ids=ids[:, :past], attention_mask=mask[:, :past],
                                                          position_ids=positions[:, :past], use_cache=True,
                                                          **with_cache(start)))
            runs = []
            for budget in (10**6, pass_tokens):
                monkeypatch.setattr(fused_prefill, "PASS_TOKENS", budget)
                runs.append(prefill(model, weights, ids[:, past:], mask, positions[:, past:],
                                    copy.deepcopy(start) if past else None, last=True))
        (whole, whole_logits), (chunked, chunked_logits) = runs
        assert chunked.get_seq_length() == whole.get_seq_length() == ids.shape[1]
        for (k1, v1), (k2, v2) in zip(real_columns(mask, whole), real_columns(mask, chunked)):
            torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(chunked_logits, whole_logits, rtol=1e-5, atol=1e-5, msg=name)
        for layer in chunked.layers:
            assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all(), name


@pytest.mark.parametrize("fused", [True, False])  # the fused prefill, and transformers' own (LoRA, other models)
@pytest.mark.parametrize("do_sample", [False, True])
def test_backend_prefills_in_column_chunks_and_samples_the_same_tokens(tiny, monkeypatch, fused, do_sample):
    """Both prefill paths chunk long passes by columns: the same tokens (fp32) as one pass, on turn 1 and on a resumed
    turn 2, with the passes really split."""
    import ragen.models.fused_prefill as fused_prefill
    from tests.models.prompts import prompts_with_groups

    model, tokenizer = tiny
    prompts = prompts_with_groups(tokenizer)
    params = SamplingParams(max_new_tokens=6, do_sample=do_sample, temperature=1.0, min_new_tokens=6)
    decoder = decoder_stack(model)
    real_pass = fused_prefill._pass
    runs = {}
    for budget in (10**6, 8):  # 8 tokens a pass: one or two columns for 4-7 rows
        monkeypatch.setattr(fused_prefill, "PASS_TOKENS", budget)
        widths = []  # columns of each pass through the model
        if fused:  # (a hook on the decoder would turn the fused path off)
            monkeypatch.setattr(fused_prefill, "_pass", lambda *a, **k: widths.append(a[2].shape[1]) or real_pass(*a, **k))
            handle = None
        else:
            handle = decoder.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]),
                                                       with_kwargs=True)
        backend = HFBackend(model, tokenizer, precision="fp32", fused_decode=fused, fused_prefill=fused)
        torch.manual_seed(0)
        try:
            with backend.session():
                out = [g.token_ids for g in backend.generate(prompts, params)]
                turn2 = [p + g + tokenizer(" next")["input_ids"] for p, g in zip(prompts, out)]
                out += [g.token_ids for g in backend.generate(turn2, params)]
                assert backend.stats.reused_tokens > 0
        finally:
            if handle is not None:
                handle.remove()
        assert (backend.fused.prefill_calls > 0) == fused
        runs[budget] = out
        prompt_passes = [w for w in widths if w > 1]  # (decode steps feed one column)
        assert prompt_passes and (max(prompt_passes) <= 2 if budget == 8 else max(prompt_passes) > 2)
    assert runs[8] == runs[10**6]


@pytest.mark.parametrize("fused_prefill", [True, False])
def test_the_fused_weights_build_is_timed_apart_from_prefill_and_decode(tiny, monkeypatch, fused_prefill):
    """``PrefillStats.weights_s`` holds the fused weights' build wherever it runs (inside the fused prefill, or the
    first fused decode step without it), once per session; ``prefill_s`` and ``decode_s`` leave it out. A build made
    1 s slower must land in ``weights_s`` alone."""
    import time

    model, tokenizer = tiny
    real_init, delay = FusedWeights.__init__, 1.0

    def slow_init(self, *args, **kwargs):
        time.sleep(delay)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(FusedWeights, "__init__", slow_init)
    prompts = [tokenizer(t)["input_ids"] for t in ["go left", "the quick brown fox jumps", "a", "go left"]]
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    backend = HFBackend(model, tokenizer, precision="fp32", fused_prefill=fused_prefill)
    start = time.perf_counter()
    with backend.session():
        first = backend.generate(prompts, params)
        second = backend.generate(prompts, params)  # the same session: the weights are not built again
    wall = time.perf_counter() - start
    stats = backend.stats
    assert (backend.fused.prefill_calls > 0) == fused_prefill and backend.fused.fused_steps > 0
    assert delay <= stats.weights_s < 2 * delay, stats  # one build, counted once
    assert stats.prefill_s < delay and stats.decode_s < delay, stats
    assert stats.prefill_s + stats.decode_s + stats.weights_s <= wall
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
