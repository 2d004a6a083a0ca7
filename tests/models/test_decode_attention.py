"""One-query decode attention equals ``sdpa`` and is used only where it may be."""

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations import sdpa_attention

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


def reference(q, k, v, mask, scale):
    """torch's SDPA on KV heads repeated as transformers' ``repeat_kv`` does, in sdpa's output layout."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                             attn_mask=None if mask is None else (mask if mask.dtype == torch.bool else mask.double()),
                                             scale=scale)
    return out.transpose(1, 2)  # (B, 1, H, D)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "broadcast"])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (6, 1)])
def test_one_query_attention_equals_sdpa(mask_kind, heads, kv_heads):
    q, k, v = qkv(heads=heads, kv_heads=kv_heads)
    B, L = q.shape[0], k.shape[2]
    mask = None
    if mask_kind in ("bool", "float"):
        keep = torch.arange(L)[None, :] >= torch.tensor([0, 3, 7, 1, 16])[:, None]  # left padding per row
        mask = keep[:, None, None, :]  # (B, 1, 1, L)
        if mask_kind == "float":
            mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))[:, None, None, :]
    elif mask_kind == "broadcast":
        mask = (torch.arange(L) % 3 != 1)[None, None, None, :]  # (1, 1, 1, L)
    out = one_query_attention(q, k, v, mask, 0.3)
    assert out.shape == (B, 1, heads, q.shape[-1]) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, 0.3), rtol=1e-5, atol=1e-6)


def test_one_query_attention_in_bf16_is_at_least_as_close_as_the_bf16_kernel():
    q, k, v = qkv(batch=32, length=135, dim=64, dtype=torch.bfloat16)
    mask = (torch.arange(135)[None, :] >= torch.arange(32)[:, None])[:, None, None, :]
    exact = reference(q, k, v, mask, 0.125)
    ours = one_query_attention(q, k, v, mask, 0.125)
    kernel = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask,
                                            scale=0.125).transpose(1, 2)
    ours_err, kernel_err = (ours.double() - exact).abs().max(), (kernel.double() - exact).abs().max()
    assert ours_err <= kernel_err + 1e-3
    assert ours_err < 0.02  # one bf16 rounding of outputs of size ~1


def call(q, k, v, mask, **kwargs):
    module = torch.nn.Module()
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    return decode_attention.decode_attention(module, q, k, v, mask, scaling=0.25, **kwargs)


@pytest.mark.parametrize("case", ["prefill", "grad", "dropout", "softcap", "sinks", "mask_shape"])
def test_other_calls_go_to_transformers_sdpa(case, monkeypatch):
    sdpa_calls = []
    real = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(decode_attention, "sdpa_attention_forward", lambda *a, **k: sdpa_calls.append(1) or real(*a, **k))
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
    elif case == "mask_shape":
        mask = torch.ones(q.shape[0], 1, 2, k.shape[2], dtype=torch.bool)  # not one query row
    with torch.set_grad_enabled(case == "grad"):
        try:
            call(q, k, v, mask, **kwargs)
        except (ValueError, RuntimeError, TypeError):
            pass  # sdpa may refuse (softcap, a mask of the wrong shape): what matters is who was asked
    assert sdpa_calls == [1]


def test_decode_calls_use_the_one_query_path(monkeypatch):
    monkeypatch.setattr(decode_attention, "sdpa_attention_forward", lambda *a, **k: pytest.fail("sdpa called"))
    q, k, v = qkv()
    with torch.no_grad():
        out, weights = call(q, k, v, None, position_ids=torch.zeros(5, 1, dtype=torch.long), sliding_window=None)
    assert weights is None
    torch.testing.assert_close(out.double(), reference(q, k, v, None, 0.25), rtol=1e-5, atol=1e-6)


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


def test_bf16_generation_matches_sdpa_within_bf16_tolerance():
    """Under bf16 autocast the decode logits stay within bf16 rounding of the flash kernel's."""
    model, tokenizer = load_model("tiny")
    batch = [tokenizer(t)["input_ids"] for t in ["The arms are Apple and Stuntman.", "Hi", "Push the box onto the target."]]
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    logits = {}
    for on in (False, True):
        seen = []
        handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.float().clone()))
        try:
            HFBackend(model, tokenizer, precision="bf16", decode_attention=on).generate(batch, params)
        finally:
            handle.remove()
        logits[on] = seen
    # the first decode step starts from identical caches: compare it (later steps may pick other tokens)
    first_plain, first_fast = logits[False][1], logits[True][1]
    torch.testing.assert_close(torch.log_softmax(first_fast, -1), torch.log_softmax(first_plain, -1), rtol=0.02, atol=0.02)
