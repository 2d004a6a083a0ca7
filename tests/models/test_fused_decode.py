"""The fused decode step computes what transformers' forward computes, and is taken only where it may be."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.cache_names import with_cache
from ragen.models.decode_attention import grouped_one_query
from ragen.models.fused_decode import FusedDecoder, fused_decode_for, unsupported_reason
from ragen.models.fused_weights import FP32_MKL_PROJECTIONS, MKL_PACK_MIN_STEPS, PROJECTIONS
from ragen.models.shared_prefix import OWN_CHUNK, SharedPrefix, _attend_grouped, _attend_shared
from ragen.models.growing_cache import GrowingLayer, make_growing
from ragen.models.packed_linear import mkl_packing_available, packing_available
from ragen.models.precision import intel_cpu

from tests.models.small_models import SMALL, small_model


def padded_batch(seed: int = 0, batch: int = 4, width: int = 13, pads=(0, 3, 0, 7)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (batch, width), generator=g)
    mask = torch.ones(batch, width, dtype=torch.long)
    for row, pad in enumerate(pads[:batch]):
        mask[row, :pad] = 0
    return ids, mask


def decode_both(model, ids, mask, steps: int = 3, bf16: bool = False, grow: bool = False, pack: bool = True,
                mkl: frozenset[str] | None = None, native: bool = True):
    """Logits of ``steps`` one-token calls after a prefill, through transformers and through the fused step."""
    out = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True, **with_cache(cache))
        if grow:
            make_growing(cache, ids.shape[1] + steps + 2)
        for arm in ("plain", "fused"):
            c = copy.deepcopy(cache)
            decoder = FusedDecoder(pack=pack)
            decoder.mkl = mkl
            decoder.native = native
            logits, token, m = [], ids[:, -1:], mask
            with fused_decode_for(model, decoder, enabled=arm == "fused") as switched:
                assert switched == (arm == "fused")
                for _ in range(steps):
                    step = model(input_ids=token, attention_mask=m, use_cache=True, **with_cache(c)).logits  # (B, 1, V)
                    logits.append(step.float())
                    token = step[:, -1].argmax(-1, keepdim=True)
                    m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
            out[arm] = (torch.cat(logits, 1), c, decoder)
    return out


@pytest.mark.parametrize("kind", ["llama", "llama_bias", "qwen2", "mistral"])
@pytest.mark.parametrize("grow", [False, True])
@pytest.mark.parametrize("pack", [True, False])  # oneDNN-packed weights, and the plain-tensor fallback
def test_fused_steps_equal_transformers_in_fp32(kind, grow, pack):
    model = small_model(kind)
    assert unsupported_reason(model) is None
    ids, mask = padded_batch()
    out = decode_both(model, ids, mask, grow=grow, pack=pack)
    (plain, plain_cache, _), (fused, fused_cache, decoder) = out["plain"], out["fused"]
    assert decoder.fused_steps == 3 and decoder.plain_calls == 0
    # fp32 by default: the LM head packed for oneDNN (where it takes fp32), q/k/v, o and gate/up packed for MKL at the
    # decode batch (where torch has MKL), down a plain view of the parameter
    weights = decoder.weights
    assert weights.head.packed == (pack and packing_available(torch.float32)) and not weights.head.mkl
    mkl = pack and mkl_packing_available() and intel_cpu()  # measured on an Intel CPU only: the default there
    for w in weights.layers:
        assert not any(linear.packed for linear in (w.qkv, w.o, w.gate_up, w.down))
        assert [linear.mkl_rows for linear in (w.qkv, w.o, w.gate_up)] == [ids.shape[0] if mkl else None] * 3
        assert w.down.mkl_rows is None
    assert FP32_MKL_PROJECTIONS == {"qkv", "o", "gate_up"}
    if pack:  # explicit sets: everything for oneDNN, everything for MKL: the same logits
        packed = decode_both(model, ids, mask, grow=grow, pack=frozenset(PROJECTIONS))["fused"]
        assert packed[2].weights.head.packed == packing_available(torch.float32)
        assert not any(linear.mkl for linear in packed[2].weights.linears())
        torch.testing.assert_close(packed[0], plain, rtol=1e-5, atol=1e-5)
        on_mkl = decode_both(model, ids, mask, grow=grow, mkl=frozenset(PROJECTIONS))["fused"]
        assert all(linear.mkl_rows == (ids.shape[0] if mkl_packing_available() else None)
                   for linear in on_mkl[2].weights.linears())
        torch.testing.assert_close(on_mkl[0], plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(plain_cache.layers, fused_cache.layers):  # the same keys and values were appended
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.values, a.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "llama_bias", "qwen2"])
def test_fp32_projections_run_on_the_panel_gemm_where_it_builds_off_intel(kind, monkeypatch):
    import ragen.models.fused_weights as fused_weights
    from ragen.models import native

    model = small_model(kind)
    ids, mask = padded_batch()
    monkeypatch.setattr(fused_weights, "intel_cpu", lambda: False)  # the default off Intel, on any machine
    out = decode_both(model, ids, mask, grow=True)
    (plain, _, _), (fused, _, decoder) = out["plain"], out["fused"]
    on = native.gemm_ops() is not None
    for w in decoder.weights.layers:  # the decoder's projections made a panel copy (4 rows); the head stays on oneDNN
        assert all((linear.panels is not None) == on for linear in (w.qkv, w.o, w.gate_up, w.down))
        assert not any(linear.mkl for linear in (w.qkv, w.o, w.gate_up, w.down))
    assert decoder.weights.head.panels is None
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    off = decode_both(model, ids, mask, grow=True, native=False)["fused"]
    assert not any(linear.panels is not None for linear in off[2].weights.linears())
    torch.testing.assert_close(off[0], fused, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(fused_weights, "intel_cpu", lambda: True)  # there MKL's packed GEMM was measured to win
    intel = decode_both(model, ids, mask, grow=True)["fused"][2]
    assert not any(linear.panels is not None for linear in intel.weights.linears())


@pytest.mark.skipif(not mkl_packing_available(), reason="torch without MKL's packed GEMM")
def test_mkl_packing_waits_for_a_call_long_enough_to_pay_for_it(tiny):
    model, tokenizer = tiny
    decoder = FusedDecoder()
    decoder.mkl = FP32_MKL_PROJECTIONS  # the default on Intel CPUs only
    weights = decoder.weights_for(model, torch.float32)
    mkl_linears = lambda: [linear for linear in weights.linears() if linear.mkl]  # noqa: E731
    assert len(mkl_linears()) == 3 * len(weights.layers) and weights.rows_pending
    decoder.call_new_tokens = MKL_PACK_MIN_STEPS + 1
    decoder.pack_rows_if_it_pays(weights, rows=4, call_steps=2)  # 23 tokens left: too few to pay
    assert weights.rows_pending and all(linear.mkl_rows is None for linear in mkl_linears())
    decoder.pack_rows_if_it_pays(weights, rows=4, call_steps=1)  # 24 left
    assert not weights.rows_pending and all(linear.mkl_rows == 4 for linear in mkl_linears())

    # through the backend: a short call leaves the session's weights plain, a long one packs them at its batch
    prompts = [tokenizer("go left")["input_ids"]] * 4
    backend = HFBackend(model, tokenizer, precision="fp32")
    backend.fused.mkl = FP32_MKL_PROJECTIONS
    with backend.session():
        backend.generate(prompts, SamplingParams(max_new_tokens=MKL_PACK_MIN_STEPS - 1, min_new_tokens=4, do_sample=False))
        assert backend.fused.weights.rows_pending and backend.fused.call_new_tokens is None  # reset after the call
        backend.generate(prompts, SamplingParams(max_new_tokens=MKL_PACK_MIN_STEPS + 1, min_new_tokens=4, do_sample=False))
        assert not backend.fused.weights.rows_pending
        assert backend.fused.weights.layers[0].qkv.mkl_rows == len(prompts)


def test_fused_steps_without_padding_and_with_explicit_positions():
    model = small_model("llama", seed=1)
    ids, mask = padded_batch(pads=(0, 0, 0, 0))
    out = decode_both(model, ids, mask)
    torch.testing.assert_close(out["fused"][0], out["plain"][0], rtol=1e-5, atol=1e-5)
    # position ids given per row (as ragen's resume prefill does): taken, not recomputed
    cache = DynamicCache(config=model.config)
    positions = torch.tensor([[12], [40], [7], [12]])
    with torch.no_grad():
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True, **with_cache(cache))
        c2 = copy.deepcopy(cache)
        plain = model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions, use_cache=True,
                      **with_cache(cache)).logits
        with fused_decode_for(model, FusedDecoder()):
            fused = model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions, use_cache=True,
                          **with_cache(c2)).logits
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_fused_steps_under_bf16_autocast_are_as_close_to_fp32_as_transformers_bf16():
    model = small_model("llama", seed=2)
    ids, mask = padded_batch(seed=2)
    exact = decode_both(model, ids, mask, steps=1)["plain"][0]
    out = decode_both(model, ids, mask, steps=1, bf16=True, grow=True)
    plain_err = (out["plain"][0] - exact).abs()
    fused_err = (out["fused"][0] - exact).abs()
    assert out["fused"][2].fused_steps == 1
    # both round the same quantities to bf16 (projections, logits); the fused GEMMs may sum in another order
    assert fused_err.max() <= 2 * plain_err.max() + 1e-3 and fused_err.mean() <= 2 * plain_err.mean() + 1e-4, \
        (fused_err.max(), plain_err.max())


def test_a_session_builds_the_weights_once_and_the_next_one_sees_the_optimizer_step(tiny):
    """ragen's fused AdamW writes parameters without bumping their versions: the copy must not outlive the session."""
    from ragen.train.optimizer import adamw

    model, tokenizer = tiny
    model = copy.deepcopy(model)
    backend = HFBackend(model, tokenizer, precision="fp32")
    backend.fused.mkl = FP32_MKL_PROJECTIONS if mkl_packing_available() else None  # MKL's packs must not outlive it
    prompts = [tokenizer("go left")["input_ids"]] * 2
    params = SamplingParams(max_new_tokens=MKL_PACK_MIN_STEPS + 1, min_new_tokens=3, do_sample=False)
    up = model.model.layers[0].mlp.up_proj.weight
    inter = model.config.intermediate_size
    with backend.session():
        backend.generate(prompts, params)
        first = backend.fused.weights
        backend.generate(prompts, params)
        assert backend.fused.weights is first  # the same rollout: built once
    assert backend.fused.weights is None
    optimizer = adamw(list(model.parameters()), lr=0.1, betas=(0.9, 0.999), weight_decay=0.0)
    assert optimizer.param_groups[0]["fused"]
    before, version = up.detach().clone(), up._version
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert not torch.equal(up.detach(), before) and up._version == version  # changed, version counter not
    with backend.session():
        backend.generate(prompts, params)
        gate_up = backend.fused.weights.layers[0].gate_up
        assert gate_up.mkl_rows == (len(prompts) if mkl_packing_available() else None)
        for rows in (3, len(prompts)):  # the plain path, and MKL's pack at the decode batch
            x = torch.randn(rows, model.config.hidden_size)
            torch.testing.assert_close(gate_up(x)[:, inter:], F.linear(x, up.detach()))
    assert FusedDecoder().weights_for(model, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("pack", [True, frozenset({"qkv", "head"}), False])
def test_weights_cast_through_the_kept_staging_buffer_stay_intact_when_it_is_reused(pack):
    """The staging buffer only feeds oneDNN's reorder: a second build through it must not change the first's weights."""
    from ragen.models.fused_weights import FusedWeights
    from ragen.models.kept_buffer import KeptBuffer

    def projections(weights, x):  # every GEMM of the fused step on the same input
        layer = weights.layers[0]
        return [layer.qkv(x), layer.o(x), layer.gate_up(x), layer.down(torch.cat([x, x], -1)[:, :128]), weights.head(x)]

    first, second = small_model("llama", seed=0), small_model("llama", seed=1)
    staging = KeptBuffer()
    x = torch.randn(5, SMALL["hidden_size"]).bfloat16()
    built = FusedWeights(first, torch.bfloat16, pack=pack, staging=staging)
    before = projections(built, x)
    buffer = staging.buffer
    FusedWeights(second, torch.bfloat16, pack=pack, staging=staging)  # overwrites the buffer
    for got, expected, fresh in zip(projections(built, x), before, projections(FusedWeights(first, torch.bfloat16, pack=pack), x)):
        assert torch.equal(got, expected) and torch.equal(got, fresh)
    if pack is not False and packing_available(torch.bfloat16):
        assert staging.buffer is buffer  # reused, not reallocated
        assert buffer.numel() == SMALL["vocab_size"] * SMALL["hidden_size"]  # the largest packed weight: the head
    elif pack is False:
        assert staging.buffer is None  # nothing packed: nothing staged


def test_calls_it_cannot_take_go_to_transformers_and_the_model_is_restored():
    model = small_model("llama", seed=4)
    ids, mask = padded_batch()
    decoder = FusedDecoder()
    with fused_decode_for(model, decoder):
        assert "forward" in vars(model)
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True, **with_cache(cache))  # prefill
            model(input_ids=ids[:, -1:], attention_mask=mask, use_cache=True, output_hidden_states=True,
                  **with_cache(copy.deepcopy(cache)))  # asks for something the fused step does not return
        model(input_ids=ids[:, -1:], attention_mask=mask, use_cache=True, **with_cache(copy.deepcopy(cache)))  # autograd on
        with torch.no_grad():
            model(input_ids=ids[:, -1:], attention_mask=mask[:, 1:], use_cache=True,
                  **with_cache(copy.deepcopy(cache)))  # mask narrower than cache + 1
    assert decoder.plain_calls == 4 and decoder.fused_steps == 0
    assert "forward" not in vars(model)
    with pytest.raises(RuntimeError, match="boom"), fused_decode_for(model, decoder):
        raise RuntimeError("boom")
    assert "forward" not in vars(model)


def test_models_it_does_not_compute_are_left_alone():
    hooked = small_model("llama")
    handle = hooked.model.layers[1].register_forward_hook(lambda *a: None)
    assert "hooks" in unsupported_reason(hooked)
    with fused_decode_for(hooked, FusedDecoder()) as switched:
        assert not switched and "forward" not in vars(hooked)
    handle.remove()
    assert unsupported_reason(hooked) is None

    sliding = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=8))
    assert "sliding" in unsupported_reason(sliding)

    patched = small_model("llama")
    patched.model.layers[0].mlp.forward = lambda x: x
    assert "patched" in unsupported_reason(patched)

    class OwnLM(LlamaForCausalLM):  # a subclass may compute something else
        pass

    assert "subclass" in unsupported_reason(OwnLM(LlamaConfig(**SMALL)))

    partial = small_model("llama_bias")
    partial.model.layers[2].self_attn.k_proj.bias = None  # biases on q and v only
    assert "some of the q/k/v" in unsupported_reason(partial)

    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(small_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert unsupported_reason(lora) is not None
    assert unsupported_reason(lora.get_base_model()) is not None  # its q/v projections are LoRA layers now


def test_backend_takes_fused_steps_and_samples_what_the_plain_path_samples(tiny):
    model, tokenizer = tiny
    prompts = [tokenizer("the box is on the target")["input_ids"], tokenizer("go left")["input_ids"]] * 2
    # with stop strings generate also hands the model its tokenizer (as in every ragen rollout)
    params = SamplingParams(max_new_tokens=6, do_sample=False, stop=("</answer>",))
    fused = HFBackend(model, tokenizer, precision="fp32", fused_decode=True)
    plain = HFBackend(model, tokenizer, precision="fp32", fused_decode=False)
    a, b = fused.generate(prompts, params), plain.generate(prompts, params)
    # every decode step fused (one per new token of the longest row but the first, which the prefill's logits gave:
    # the prefill ran each prompt's last token too, through the fused weights)
    assert fused.fused.fused_steps == max(len(g.token_ids) for g in a) - 1 and fused.fused.plain_calls == 0
    assert fused.fused.prefill_calls > 0 and fused.stats.decode_fed_tokens == 0
    assert plain.fused.fused_steps == 0
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert fused.fused.weights is None  # outside a session the copy is freed after the call


def test_backend_resumes_kept_caches_through_the_fused_step_as_through_transformers(tiny):
    """Turn 2 of a session resumes kept KV caches: padding inside rows, explicit positions, growing layers."""
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    torch.manual_seed(0)
    prompts = [torch.randint(10, 1000, (n,)).tolist() for n in (12, 20, 7, 15)]
    outputs = {}
    for on in (False, True):
        backend = HFBackend(model, tokenizer, precision="fp32", fused_decode=on)
        with backend.session():
            first = backend.generate(prompts, params)
            again = [prompts[i] + first[i].token_ids + [5, 6, 7, 8][: i + 1] for i in range(4)]
            second = backend.generate(again, params)
            assert backend.stats.reused_tokens > 0
        outputs[on] = ([g.token_ids for g in first], [g.token_ids for g in second], backend.fused.fused_steps)
    assert outputs[True][2] > 0 and outputs[False][2] == 0
    assert outputs[True][:2] == outputs[False][:2]


def test_a_sessions_calls_reuse_the_prefix_pages_and_the_session_frees_them(tiny, monkeypatch):
    model, tokenizer = tiny
    a, b = (tokenizer(t)["input_ids"] for t in ("push the box", "the box is on the target now"))
    params = SamplingParams(max_new_tokens=4, do_sample=False)
    backend = HFBackend(model, tokenizer, precision="fp32")
    seen = []
    real = SharedPrefix.from_layers.__func__

    def spy(cls, *args, pages=None, **kwargs):
        prefix = real(cls, *args, pages=pages, **kwargs)
        seen.append((prefix.keys_t[0].data_ptr(), pages is not None))
        return prefix

    monkeypatch.setattr(SharedPrefix, "from_layers", classmethod(spy))
    with backend.session(keep_kv=False):
        first = backend.generate([a] * 3 + [b] * 3, params)
        second = backend.generate([a] * 3 + [b] * 3, params)
        assert len(backend.fused.prefix_pages) == 2 * model.config.num_hidden_layers
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0][1]  # the second call's copies landed on the same pages
    assert backend.fused.prefix_pages == []  # freed with the session
    backend.generate([a] * 3 + [b] * 3, params)
    assert len(seen) == 3 and not seen[2][1]  # outside a session: fresh tensors, nothing keeps them


def test_min_new_tokens_keeps_eos_out_until_then(tiny):
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    prompts = [tokenizer("hello")["input_ids"]] * 3
    backend = HFBackend(model, tokenizer, precision="fp32")
    # make EOS overwhelmingly likely: without the floor every row would end at its first token
    with torch.no_grad():
        bias = torch.zeros(model.config.vocab_size)
        bias[eos] = 50.0
        handle = model.lm_head.register_forward_hook(lambda m, a, out: out + bias)
    try:
        free = backend.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0))
        floored = backend.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, min_new_tokens=4))
        greedy = backend.generate(prompts, SamplingParams(max_new_tokens=8, do_sample=False, min_new_tokens=3))
    finally:
        handle.remove()
    assert all(g.token_ids == [eos] and g.finish_reason == "eos" for g in free)
    for g in floored:
        assert eos not in g.token_ids[:4] and g.token_ids[4] == eos and g.finish_reason == "eos"
    for g in greedy:  # transformers' own min_new_tokens processor on the greedy path
        assert eos not in g.token_ids[:3] and g.token_ids[3] == eos


@pytest.mark.slow
def test_embedded_model_fused_logits_match_transformers():
    model, _ = load_model("smollm2-135m")
    model.eval()
    ids, mask = padded_batch(width=20, pads=(0, 5, 0, 2))
    out = decode_both(model, ids.clamp(max=model.config.vocab_size - 1), mask, steps=2, grow=True)
    torch.testing.assert_close(out["fused"][0], out["plain"][0], rtol=1e-4, atol=2e-4)


class _Layer:  # what SharedPrefix.from_layers reads of a cache layer
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


@pytest.mark.parametrize("group,padded", [(4, True), (2, False), (1, True)])
def test_shared_prefix_attention_equals_attention_over_each_rows_cache(group, padded):
    g = torch.Generator().manual_seed(group)
    U, H_kv, q_heads, D, Lp, own = 3, 2, 3, 8, 11, 5
    B = U * group
    prefix_k, prefix_v = torch.randn(U, H_kv, Lp, D, generator=g), torch.randn(U, H_kv, Lp, D, generator=g)
    rows = torch.arange(B) // group  # row -> its prompt
    keys = torch.cat([prefix_k[rows], torch.randn(B, H_kv, own, D, generator=g)], dim=2)  # (B, H_kv, L, D)
    values = torch.cat([prefix_v[rows].bfloat16().float(), torch.randn(B, H_kv, own, D, generator=g)], dim=2)
    query = torch.randn(B, H_kv, q_heads, D, generator=g)
    mask = torch.ones(B, Lp + own, dtype=torch.bool)
    if padded:
        for u, pad in enumerate((0, 4, 7)):  # left padding of each prompt, the same for its rows
            mask[rows == u, :pad] = False
    padding = (~mask)[:, None, None, :]
    prefix = SharedPrefix.from_layers([_Layer(prefix_k, prefix_v.bfloat16())], group, padding=~mask[::group, :Lp])
    assert (prefix.padding is not None) == padded
    out = _attend_shared(query, keys, values, padding if padded else None, 0.3, prefix, 0)
    expected = grouped_one_query(query, keys, values, 0.3, padding if padded else None)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_backend_reads_shared_prompts_once_per_group_and_samples_the_same_tokens(tiny):
    model, tokenizer = tiny
    a, b, c = (tokenizer(t)["input_ids"] for t in ("push the box", "the box is on the target now", "go"))
    prompts = [a] * 3 + [b] * 3 + [c] * 3  # groups of 3 consecutive rows, prompts of different lengths: padding
    params = SamplingParams(max_new_tokens=5, do_sample=False)
    shared = HFBackend(model, tokenizer, precision="fp32")
    plain = HFBackend(model, tokenizer, precision="fp32", fused_decode=False)
    deferrals, copies = [], []
    real_reorder, real_materialize = GrowingLayer.reorder_cache, GrowingLayer._materialize

    def reorder(self, index):
        real_reorder(self, index)
        deferrals.append(self.deferred)

    with pytest.MonkeyPatch.context() as patch:  # see the prompt's row copy deferred, and count the ones that ran
        patch.setattr(GrowingLayer, "reorder_cache", reorder)
        patch.setattr(GrowingLayer, "_materialize", lambda self: copies.append(self.deferred) or real_materialize(self))
        got = shared.generate(prompts, params)
    assert shared.fused.shared_prefix_steps == shared.fused.fused_steps > 0 and shared.fused.prefix is None
    assert deferrals and all(deferrals)  # the prompt cache was spread to the group's rows, lazily
    assert not any(copies)  # grouped steps read the prompt from the shared prefix: the rows' copy never ran
    assert shared.fused.grouped_steps == shared.fused.fused_steps  # own columns read per group too
    assert [g.token_ids for g in got] == [g.token_ids for g in plain.generate(prompts, params)]
    mixed = [a, b, a, b]  # not in consecutive groups: each row attends over its own cache
    fused_before = shared.fused.shared_prefix_steps
    assert [g.token_ids for g in shared.generate(mixed, params)] == [g.token_ids for g in plain.generate(mixed, params)]
    assert shared.fused.shared_prefix_steps == fused_before


@pytest.mark.parametrize("group,padded", [(4, True), (2, False), (1, True)])
def test_grouped_own_columns_step_by_step_equal_attention_over_each_rows_cache(group, padded):
    g = torch.Generator().manual_seed(10 + group)
    U, H_kv, q_heads, D, Lp, steps = 3, 2, 3, 8, 11, 4 + OWN_CHUNK  # past one chunk: the buffers grow once
    B = U * group
    prefix_k, prefix_v = torch.randn(U, H_kv, Lp, D, generator=g), torch.randn(U, H_kv, Lp, D, generator=g)
    rows = torch.arange(B) // group
    mask = torch.ones(B, Lp, dtype=torch.bool)
    if padded:
        for u, pad in enumerate((0, 4, 7)):
            mask[rows == u, :pad] = False
    prefix = SharedPrefix.from_layers([_Layer(prefix_k, prefix_v.bfloat16())], group, padding=~mask[::group], capacity=steps)
    keys, values = prefix_k[rows], prefix_v[rows].bfloat16().float()  # each row's cache: (B, H_kv, L, D)
    for step in range(steps):
        key = torch.randn(B, H_kv, 1, D, generator=g)
        value = torch.randn(B, H_kv, 1, D, generator=g).bfloat16()
        keys, values = torch.cat([keys, key], 2), torch.cat([values, value.float()], 2)
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.bool)], 1)
        padding = (~mask)[:, None, None, :] if padded else None
        assert prefix.grouped_step(Lp + step, padding)
        query = torch.randn(B, H_kv, q_heads, D, generator=g)
        out = _attend_grouped(query, key, value, 0.3, prefix, 0)
        prefix.own_steps += 1
        torch.testing.assert_close(out, grouped_one_query(query, keys, values, 0.3, padding), rtol=1e-5, atol=1e-6)
    assert not prefix.grouped_step(Lp + steps, None) and prefix.own_steps is None  # no room left: per-row from now on


def test_grouped_steps_stop_when_a_step_went_elsewhere_or_an_own_column_is_padding():
    k = torch.randn(2, 1, 5, 4)
    prefix = SharedPrefix.from_layers([_Layer(k, k.bfloat16())], 2, padding=None, capacity=8)
    assert prefix.grouped_step(5, None)  # the first step after the prefix
    assert not prefix.grouped_step(7, None)  # a step was not kept (it ran elsewhere): the copies are incomplete
    assert not prefix.grouped_step(5, None)  # ... and stay unused for the rest of the call
    prefix = SharedPrefix.from_layers([_Layer(k, k.bfloat16())], 2, padding=None, capacity=8)
    padding = torch.zeros(4, 1, 1, 6, dtype=torch.bool)
    padding[1, ..., 5] = True  # an own column masked out
    assert not prefix.grouped_step(5, padding)
    assert not SharedPrefix.from_layers([_Layer(k, k.bfloat16())], 2, padding=None).grouped_step(5, None)  # no capacity


def test_rotary_and_rms_norm_are_transformers_bit_for_bit():
    """The fused passes' rotary embedding and RMS norm compute transformers' Llama operations exactly: fp32 and bf16,
    the rotation's input in fp32 or as a bf16 projection's output, the norm op by op or (fp32) as ``F.rms_norm``."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from ragen.models.fused_decode import _rms_norm, _rotate, signed_sin

    g = torch.Generator().manual_seed(11)
    for scale in (1e-3, 1.0, 1e3):
        q = torch.randn(5, 9, 7, 64, generator=g) * scale  # (B, heads, T, D)
        cos, sin = torch.randn(5, 7, 64, generator=g), torch.randn(5, 7, 64, generator=g)  # (B, T, D)
        tables = cos[:, :, None], signed_sin(sin[:, :, None])  # (B, T, 1, D)
        for q_in in (q, q.bfloat16()):  # a bf16 projection's output is rotated in fp32, as transformers upcasts it
            expected, _ = apply_rotary_pos_emb(q_in.float(), q_in.float(), cos, sin)  # unsqueezes cos/sin at dim 1
            got = _rotate(q_in.transpose(1, 2), *tables).transpose(1, 2)
            assert got.dtype == torch.float32 and torch.equal(got, expected), (scale, q_in.dtype)
        for dtype in (torch.float32, torch.bfloat16):
            for width, shape in ((64, (6, 3)), (576, (32,)), (576, (8, 68))):  # SmolLM2's width: decode and prefill
                norm = LlamaRMSNorm(width, eps=1e-6).to(dtype)
                with torch.no_grad():
                    norm.weight.copy_(torch.randn(width, generator=g))
                h = (torch.randn(*shape, width, generator=g) * scale).to(dtype)
                assert torch.equal(_rms_norm(h, norm.weight.detach(), 1e-6), norm(h).detach()), (scale, dtype, shape)
