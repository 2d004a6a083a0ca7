"""One-query decode attention equals ``sdpa`` and is used only where it may be."""

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations import sdpa_attention

import ragen.models.attention_switch as attention_switch
import ragen.models.decode_attention as decode_attention
from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.decode_attention import decode_attention_for, one_query_attention


def qkv(batch=5, heads=9, kv_heads=3, length=17, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype)
    return q, k, v


def reference(q, k, v, scale, mask=None):
    """torch's SDPA (math kernel, float64) on KV heads repeated as transformers' ``repeat_kv`` does, in sdpa's output layout."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)  # (B, 1, H, D)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (6, 1)])
@pytest.mark.parametrize("batch,length", [(5, 17), (1, 1), (3, 200)])
def test_one_query_attention_equals_sdpa(heads, kv_heads, batch, length):
    q, k, v = qkv(batch=batch, heads=heads, kv_heads=kv_heads, length=length)
    out = one_query_attention(q, k, v, 0.3)
    assert out.shape == (batch, 1, heads, q.shape[-1]) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.3), rtol=1e-5, atol=1e-6)


def test_value_heads_may_be_narrower_than_query_heads():
    q, k, _ = qkv(batch=3, length=11, dim=8)
    v = torch.randn(3, 3, 11, 4)  # Dv = 4 != D = 8
    out = one_query_attention(q, k, v, 0.3)
    assert out.shape == (3, 1, 9, 4)
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("autocast", [False, True])  # generate calls it inside bf16 autocast
def test_one_query_attention_in_bf16_is_at_least_as_close_as_the_bf16_kernel(autocast):
    q, k, v = qkv(batch=32, length=135, dim=64, dtype=torch.bfloat16)
    exact = reference(q, k, v, 0.125)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ours = one_query_attention(q, k, v, 0.125)
        kernel = F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True).transpose(1, 2)
    ours_err, kernel_err = (ours.double() - exact).abs().max(), (kernel.double() - exact).abs().max()
    ours_mean, kernel_mean = (ours.double() - exact).abs().mean(), (kernel.double() - exact).abs().mean()
    assert ours.dtype == torch.bfloat16
    assert ours_err <= kernel_err and ours_mean <= kernel_mean, (ours_err, kernel_err, ours_mean, kernel_mean)
    assert ours_err < 0.02  # one bf16 rounding of outputs of size ~1


def call(q, k, v, mask, **kwargs):
    module = torch.nn.Module()
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    return decode_attention.decode_attention(module, q, k, v, mask, scaling=0.25, **kwargs)


@pytest.mark.parametrize("case", ["prefill", "grad", "dropout", "softcap", "sinks", "padding_mask"])
def test_other_calls_go_to_transformers_sdpa(case, monkeypatch):
    sdpa_calls = []
    real = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(attention_switch, "sdpa_attention_forward", lambda *a, **k: sdpa_calls.append(1) or real(*a, **k))
    q, k, v = qkv()
    kwargs, mask = {}, None
    if case == "prefill":
        q = torch.randn(q.shape[0], q.shape[1], 4, q.shape[-1])
    elif case == "dropout":
        kwargs = {"dropout": 0.1}
    elif case == "softcap":
        kwargs = {"softcap": 30.0}
    elif case == "sinks":
        kwargs = {"s_aux": torch.zeros(q.shape[1])}
    elif case == "padding_mask":
        mask = torch.ones(q.shape[0], 1, 1, k.shape[2], dtype=torch.bool)  # sdpa is as fast with a mask: it keeps those
    with torch.set_grad_enabled(case == "grad"):
        try:
            call(q, k, v, mask, **kwargs)
        except (ValueError, RuntimeError, TypeError):
            pass  # sdpa may refuse (softcap): what matters is who was asked
    assert sdpa_calls == [1]


def test_decode_calls_use_the_one_query_path(monkeypatch):
    monkeypatch.setattr(attention_switch, "sdpa_attention_forward", lambda *a, **k: pytest.fail("sdpa called"))
    q, k, v = qkv()
    with torch.no_grad():
        out, weights = call(q, k, v, None, position_ids=torch.zeros(5, 1, dtype=torch.long), sliding_window=None)
    assert weights is None
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.25), rtol=1e-5, atol=1e-6)


def test_the_switch_is_scoped_restored_on_error_and_leaves_other_implementations_alone():
    model, _ = load_model("tiny")
    assert model.config._attn_implementation == "sdpa"
    with decode_attention_for(model) as on:
        assert on and model.config._attn_implementation == decode_attention.NAME
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(KeyError), decode_attention_for(model):
        raise KeyError("boom")
    assert model.config._attn_implementation == "sdpa"
    with decode_attention_for(model, enabled=False) as on:
        assert not on and model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with decode_attention_for(model) as on:
        assert not on and model.config._attn_implementation == "eager"


def equal_length_prompts(tokenizer):
    """Rows of one length: transformers passes no mask, the case the one-query path takes."""
    ids = [tokenizer(t)["input_ids"] for t in ["The arms are Apple and Stuntman today.", "Push the box onto the target, now."]]
    n = min(map(len, ids))
    return [ids[0][:n]] * 3 + [ids[1][:n]] * 2


def generate_capturing(model, tokenizer, precision, on, params, monkeypatch):
    calls = []
    real = one_query_attention  # the module's own function, not an earlier call's counting wrapper
    monkeypatch.setattr(decode_attention, "one_query_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.float().clone()))
    try:
        torch.manual_seed(0)
        gens = HFBackend(model, tokenizer, precision=precision, decode_attention=on).generate(equal_length_prompts(tokenizer), params)
    finally:
        handle.remove()
    return gens, seen, calls


@pytest.mark.parametrize("do_sample", [False, True])
def test_fp32_generation_gives_sdpas_tokens_and_logits(monkeypatch, do_sample):
    model, tokenizer = load_model("tiny")
    params = SamplingParams(max_new_tokens=10, do_sample=do_sample)
    plain, plain_logits, plain_calls = generate_capturing(model, tokenizer, "fp32", False, params, monkeypatch)
    fast, fast_logits, fast_calls = generate_capturing(model, tokenizer, "fp32", True, params, monkeypatch)
    assert not plain_calls
    # every decode step (each head call: the shared prefill runs the decoder alone) attends with one query per layer
    assert len(fast_calls) == len(fast_logits) * model.config.num_hidden_layers > 0
    assert model.config._attn_implementation == "sdpa"
    assert [g.token_ids for g in fast] == [g.token_ids for g in plain]
    assert len(fast_logits) == len(plain_logits)
    for a, b in zip(fast_logits, plain_logits):
        torch.testing.assert_close(torch.log_softmax(a, -1), torch.log_softmax(b, -1), rtol=1e-5, atol=1e-5)


def test_bf16_generation_matches_sdpa_within_bf16_tolerance(monkeypatch):
    """Under bf16 autocast the decode log-probs stay within bf16 rounding of the flash kernel's."""
    model, tokenizer = load_model("tiny")
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    _, plain_logits, _ = generate_capturing(model, tokenizer, "bf16", False, params, monkeypatch)
    _, fast_logits, fast_calls = generate_capturing(model, tokenizer, "bf16", True, params, monkeypatch)
    assert fast_calls
    # the first decode step starts from identical caches: compare it (later steps may pick other tokens)
    torch.testing.assert_close(torch.log_softmax(fast_logits[0], -1), torch.log_softmax(plain_logits[0], -1),
                               rtol=0.02, atol=0.02)
