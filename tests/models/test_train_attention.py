"""Grouped fp32 training attention equals sdpa (values and gradients) and is used only where it may be."""

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations import sdpa_attention

import ragen.models.attention_switch as attention_switch
import ragen.models.train_attention as train_attention
import ragen.train.logprobs as logprobs
from ragen.models.train_attention import grouped_attention, train_attention_for
from ragen.train.logprobs import policy_forward


def qkv(batch=3, heads=6, kv_heads=2, queries=5, length=9, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return make(batch, heads, queries, dim), make(batch, kv_heads, length, dim), make(batch, kv_heads, length, dim)


def padding_mask(batch, queries, length):
    """Causal (aligned to the last key) with 0-2 left-padded keys per row: (B, 1, q, L) bool, True = attend."""
    mask = torch.ones(batch, 1, queries, length, dtype=torch.bool).tril(length - queries)
    for b in range(batch):
        mask[b, ..., : b % 3] = False
    return mask


def reference(q, k, v, scale, mask=None, causal=False):
    """float64 math SDPA on KV heads repeated as transformers' repeat_kv does; (B, q, H, D)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask, scale=scale, is_causal=causal)
    return out.transpose(1, 2)


def values_and_grads(fn, q, k, v):
    out = fn(q, k, v)
    upstream = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return (out, *torch.autograd.grad((out * upstream).sum(), (q, k, v)))


@pytest.mark.parametrize("kind", ["bool", "additive", "causal", "none"])
def test_values_and_gradients_equal_float64_sdpa(kind):
    q, k, v = qkv(queries=9 if kind == "causal" else 5)
    B, Q, L = q.shape[0], q.shape[2], k.shape[2]
    mask = {"bool": padding_mask(B, Q, L), "none": None, "causal": None,
            "additive": torch.randn(B, 1, Q, L, generator=torch.Generator().manual_seed(1))}[kind]
    ours = values_and_grads(lambda q, k, v: grouped_attention(q, k, v, mask, 0.3, causal=kind == "causal"), q, k, v)
    want = values_and_grads(lambda q, k, v: reference(q, k, v, 0.3, mask, causal=kind == "causal"), q, k, v)
    assert ours[0].shape == (B, Q, 6, 8) and ours[0].dtype == torch.float32
    for a, b in zip(ours, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-6)


def test_causal_with_fewer_queries_than_keys_aligns_to_the_last_key():
    """A continuation of 5 queries on 9 keys (4 cached): query i sees keys 0 .. 4 + i."""
    q, k, v = qkv()
    aligned = torch.ones(5, 9, dtype=torch.bool).tril(4)
    torch.testing.assert_close(grouped_attention(q, k, v, None, 0.3, causal=True).double(),
                               reference(q, k, v, 0.3, aligned), rtol=1e-5, atol=1e-6)


def test_value_heads_may_be_narrower():
    q, k, _ = qkv()
    v = torch.randn(3, 2, 9, 4, requires_grad=True)
    mask = padding_mask(3, 5, 9)
    torch.testing.assert_close(grouped_attention(q, k, v, mask, 0.3).double(), reference(q, k, v, 0.3, mask), rtol=1e-5, atol=1e-6)


def test_bf16_under_autocast_is_no_less_exact_than_the_flash_kernel():
    """At an update's shape, output and input gradients against float64: no larger relative error than sdpa's."""
    q, k, v = qkv(batch=4, heads=9, kv_heads=3, queries=32, length=80, dim=64, dtype=torch.bfloat16)
    mask = padding_mask(4, 32, 80)
    want = values_and_grads(lambda q, k, v: reference(q, k, v, 0.125, mask), q, k, v)

    def kernel(q, k, v):
        rep = lambda x: x.repeat_interleave(3, 1)  # noqa: E731 (what transformers does with a mask)
        return F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask, scale=0.125).transpose(1, 2)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = values_and_grads(lambda q, k, v: grouped_attention(q, k, v, mask, 0.125), q, k, v)
        flash = values_and_grads(kernel, q, k, v)
    assert ours[0].dtype == torch.bfloat16
    for name, a, f, r in zip(("out", "dq", "dk", "dv"), ours, flash, want):
        err = lambda x: ((x.double() - r).abs().max() / r.abs().max()).item()  # noqa: E731
        assert err(a) <= err(f), (name, err(a), err(f))


def test_rows_with_every_key_masked_stay_finite():
    q, k, v = qkv()
    mask = padding_mask(3, 5, 9)
    mask[1, :, 0] = False  # row 1's first query sees nothing
    out, dq, dk, dv = values_and_grads(lambda q, k, v: grouped_attention(q, k, v, mask, 0.3), q, k, v)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1, 0] = False
    torch.testing.assert_close(out[keep].double(), reference(q, k, v, 0.3, padding_mask(3, 5, 9))[keep], rtol=1e-5, atol=1e-6)


def call(q, k, v, mask, **kwargs):
    module = torch.nn.Module()
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    return train_attention.train_attention(module, q, k, v, mask, scaling=0.3, **kwargs)


@pytest.mark.parametrize("case", ["too_big", "dropout", "softcap", "no_mask", "odd_mask"])
def test_other_calls_go_to_transformers_sdpa(case, monkeypatch):
    sdpa_calls, grouped_calls = [], []
    real_sdpa, real_grouped = sdpa_attention.sdpa_attention_forward, train_attention.grouped_attention
    monkeypatch.setattr(attention_switch, "sdpa_attention_forward", lambda *a, **k: sdpa_calls.append(1) or real_sdpa(*a, **k))
    monkeypatch.setattr(train_attention, "grouped_attention", lambda *a, **k: grouped_calls.append(1) or real_grouped(*a, **k))
    q, k, v = qkv()
    mask, kwargs = padding_mask(3, 5, 9), {}
    if case == "too_big":
        monkeypatch.setattr(train_attention, "MAX_SCORES", 3 * 6 * 5 * 9 - 1)
    elif case == "dropout":
        kwargs["dropout"] = 0.1
    elif case == "softcap":
        kwargs["softcap"] = 30.0
    elif case == "no_mask":
        mask, kwargs["is_causal"] = None, True  # sdpa's flash kernel on the KV heads, causal half skipped
    elif case == "odd_mask":
        mask = mask[:, :, None]  # 5-d: not a mask transformers builds
    with torch.no_grad():
        try:
            call(q, k, v, mask, **kwargs)
        except (ValueError, RuntimeError):
            pass  # sdpa may refuse the argument; what matters is who got the call
    assert sdpa_calls == [1] and grouped_calls == []
    monkeypatch.setattr(train_attention, "MAX_SCORES", 2**21)
    call(q, k, v, padding_mask(3, 5, 9))
    assert grouped_calls == [1]


def test_the_switch_is_scoped_restored_on_error_and_leaves_other_implementations_alone(tiny):
    model, _ = tiny
    assert model.config._attn_implementation == "sdpa"
    with train_attention_for(model) as on:
        assert on and model.config._attn_implementation == train_attention.NAME
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), train_attention_for(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    try:
        with train_attention_for(model) as on:
            assert not on and model.config._attn_implementation == "eager"
    finally:
        model.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("layout, passes", [("split", 2), ("packed", 1)])
def test_policy_forward_gives_sdpas_logprobs_and_gradients(tiny, monkeypatch, layout, passes):
    """The update's pass with the switch (its attention calls counted) against the same pass on sdpa, in both
    shared-prompt layouts (ragen/train/packed_groups.py: the packed one's block mask reaches the switch too)."""
    model, _ = tiny
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (4, 18), generator=g)
    ids[1:, :8] = ids[1, :8]  # rows 1-3 share an 8-token prompt, row 0 has a 6-token one: the prompt pass is padded
    mask = torch.ones_like(ids)
    mask[0, 15:] = 0
    response = torch.zeros(4, 17)
    response[:, 7:] = 1
    response[0, 5:7] = 1
    response[0, 14:] = 0
    prompt_lengths = torch.tensor([6, 8, 8, 8])
    calls = []
    real = train_attention.grouped_attention
    monkeypatch.setattr(train_attention, "grouped_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_switch = logprobs.train_attention_for
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(logprobs, "train_attention_for", lambda model, enabled=enabled, _on=enabled: real_switch(model, _on))
        model.zero_grad(set_to_none=True)
        out = policy_forward(model, ids, mask, response, prompt_lengths=prompt_lengths, prompt_layout=layout)
        (-(out.logprobs * response).sum()).backward()
        results.append((out.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert len(calls) == passes * model.config.num_hidden_layers  # split: prompt pass and continuation pass, every layer
    (lp_a, grads_a), (lp_b, grads_b) = results
    torch.testing.assert_close(lp_a, lp_b, rtol=1e-5, atol=1e-5)
    for name, grad in grads_b.items():
        assert (grads_a[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-9, name


def test_a_checkpointed_model_keeps_sdpa(tiny, monkeypatch):
    """Its backward recomputes the layers after policy_forward's block: both passes must use one implementation."""
    import copy

    from ragen.models.checkpointing import enable_checkpointing

    model = copy.deepcopy(tiny[0])
    model.train()
    enable_checkpointing(model)
    calls = []
    real = train_attention.grouped_attention
    monkeypatch.setattr(train_attention, "grouped_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0  # padding: a mask reaches the attention calls
    response = torch.zeros(3, 11)
    response[:, 5:] = 1
    response[0, 8:] = 0
    out = policy_forward(model, ids, mask, response)
    (-(out.logprobs * response).sum()).backward()  # would raise torch's CheckpointError on a mismatch
    assert calls == []
    with torch.no_grad():  # scoring passes (no backward) still take it
        policy_forward(model, ids, mask, response)
    assert calls


@pytest.mark.parametrize("switch", ["train", "decode"])
def test_models_that_test_the_sdpa_name_themselves_are_not_switched(tiny, monkeypatch, switch):
    """Without transformers' ``_supports_attention_backend`` (Falcon) a model compares the name with "sdpa"
    itself and would take another branch under ours: no switch."""
    from ragen.models.decode_attention import decode_attention_for

    model, _ = tiny
    monkeypatch.setattr(type(model), "_supports_attention_backend", False)
    with (train_attention_for if switch == "train" else decode_attention_for)(model) as on:
        assert not on and model.config._attn_implementation == "sdpa"


def test_a_model_without_a_layers_list_still_trains():
    """GPT-2 keeps its blocks in ``h``: the checkpointing check must not stop its training pass."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64)).train()
    ids = torch.randint(0, 97, (2, 10))
    response = torch.zeros(2, 9)
    response[:, 4:] = 1
    out = policy_forward(model, ids, torch.ones_like(ids), response)
    (-(out.logprobs * response).sum()).backward()
    assert model.transformer.wte.weight.grad is not None


def test_a_boolean_mask_gives_masked_fills_values_and_gradients_bit_for_bit():
    """The boolean mask is applied as an additive (0 | lowest) bias: the same bits as masked_fill(~mask, lowest)
    (lowest + score rounds to lowest; a masked key's probability is exactly 0, so is its score's gradient). A
    query with every key masked (padding) gets the same values, but a gradient where masked_fill's is zero; in a
    model no loss reaches such a row (its hidden state is padding), so its upstream gradient is zero either way."""
    q, k, v = qkv(queries=7, length=11)
    mask = padding_mask(3, 7, 11)
    lowest = torch.finfo(torch.float32).min

    def masked_fill_version(q, k, v):
        B, H, Q, D = q.shape
        kv, L = k.shape[1], k.shape[2]
        scores = torch.matmul(q.reshape(B, kv, H // kv * Q, D), k.transpose(-1, -2)).mul_(0.3).view(B, kv, H // kv, Q, L)
        probs = torch.softmax(scores.masked_fill(~mask[:, :, None], lowest), -1).view(B, kv, H // kv * Q, L)
        return torch.matmul(probs, v).view(B, H, Q, -1).transpose(1, 2).contiguous()

    got = values_and_grads(lambda q, k, v: grouped_attention(q, k, v, mask, 0.3), q, k, v)
    expected = values_and_grads(masked_fill_version, q, k, v)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
