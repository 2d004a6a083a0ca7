"""Decode levers: linears as ``(W @ hᵀ)ᵀ`` and a KV cache that grows in place give the plain path's tokens and logits."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM
from transformers.cache_utils import DynamicCache, DynamicLayer

import ragen.models.transposed_gemm as transposed_gemm
from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.cache_names import output_cache
from ragen.models.growing_cache import GrowingLayer, make_growing
from ragen.models.transposed_gemm import output_head, transposable, transposed_linear, transposed_linears
from ragen.models.lora import apply_lora
from ragen.models.tiny import tiny_config


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def prompts(tokenizer):
    texts = ["The arms are Apple and Stuntman.", "Sokoban: push the box X onto the target O, please now.", "Hi"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    return [ids[0]] * 3 + [ids[1]] * 2 + [ids[2]] + [ids[0]]  # groups sharing prompts, different lengths


# ---------------------------------------------------------------------------- transposed linears
@pytest.mark.parametrize("bias", [False, True])
def test_transposed_linear_is_linear_with_the_same_gradients(bias):
    torch.manual_seed(0)
    w = torch.randn(300, 24, requires_grad=True)
    b = torch.randn(300, requires_grad=True) if bias else None
    h = torch.randn(2, 5, 24, requires_grad=True)
    ref = F.linear(h, w, b)
    out = transposed_linear(h, w, b)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [h, w] + ([b] if bias else []), g)
    grads = torch.autograd.grad(out, [h, w] + ([b] if bias else []), g)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_transposed_linear_at_smollm2_sizes_matches_linear_up_to_rounding(bias):
    torch.manual_seed(0)
    for out_features, in_features in [(576, 576), (192, 576), (1536, 576), (576, 1536)]:
        w = torch.randn(out_features, in_features) / in_features**0.5
        b = torch.randn(out_features) if bias else None
        for rows in (1, 2, 7, 11, 16, 64, 256):
            h = torch.randn(rows, in_features)
            torch.testing.assert_close(transposed_linear(h, w, b), F.linear(h, w, b), rtol=1e-5, atol=1e-5)


def test_fast_decode_false_turns_both_levers_off(tiny, tmp_path):
    from ragen.config import load_config

    model, tokenizer = tiny
    for on in (True, False):
        config = load_config("bandit", ["model=tiny", f"rollout.fast_decode={str(on).lower()}", f"trainer.output_dir={tmp_path}"])
        backend = HFBackend.from_config(model, tokenizer, config)
        assert backend.transposed_gemm is on and backend.grow_cache is on and backend.decode_attention is on


def capture_head(model):
    """Every LM-head output during a call (forward hooks run whichever forward the head uses)."""
    seen = []
    handle = output_head(model).register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    return seen, handle


def linear_count(model) -> int:
    return sum(1 for m in model.modules() if type(m) is torch.nn.Linear)


def count_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("do_sample", [False, True])
def test_levers_give_the_plain_paths_tokens_and_logits(tiny, monkeypatch, do_sample):
    model, tokenizer = tiny
    batch = prompts(tokenizer)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, do_sample=do_sample)
    runs = {}
    for levers in (False, True):
        backend = HFBackend(model, tokenizer, precision="fp32", transposed_gemm=levers, grow_cache=levers,
                            decode_attention=levers)
        gemm_calls = count_calls(monkeypatch, transposed_gemm, "transposed_linear")
        grow_updates = count_calls(monkeypatch, GrowingLayer, "update")

        seen, handle = capture_head(model)
        try:
            torch.manual_seed(0)
            gens = backend.generate(batch, params)
        finally:
            handle.remove()
        runs[levers] = gens, seen
        # the levers really ran (or really did not): a silent fallback fails here
        # each decode step calls every linear once, the shared prefill all but the head (it runs the decoder alone);
        # all calls here are short enough for the lever
        assert len(gemm_calls) == ((len(seen) + 1) * linear_count(model) - 1 if levers else 0)
        assert bool(grow_updates) == levers
        assert not any("forward" in vars(m) for m in model.modules())  # every linear is restored after generate
        assert model.config._attn_implementation == "sdpa"  # and the attention implementation
    (plain, plain_logits), (fast, fast_logits) = runs[False], runs[True]
    assert [g.token_ids for g in fast] == [g.token_ids for g in plain]
    assert [g.finish_reason for g in fast] == [g.finish_reason for g in plain]
    assert len(fast_logits) == len(plain_logits) > 2
    for a, b in zip(fast_logits, plain_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.log_softmax(a, -1), torch.log_softmax(b, -1), rtol=1e-5, atol=1e-5)


def test_linears_are_switched_only_inside_the_block_and_restored_on_error(tiny):
    model, _ = tiny
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert output_head(model) in linears and len(linears) > 7  # the head and each layer's projections
    ids = torch.tensor([[1, 5, 9, 200, 17]])
    with torch.no_grad():
        ref = model(ids).logits
        with transposed_linears(model) as switched:
            assert switched == linears and all("forward" in vars(m) for m in linears)
            out = model(ids).logits
        assert not any("forward" in vars(m) for m in linears)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="boom"):
            with transposed_linears(model):
                raise RuntimeError("boom")
        assert not any("forward" in vars(m) for m in linears)


def test_calls_with_more_rows_than_max_rows_run_the_plain_linear(tiny, monkeypatch):
    model, _ = tiny
    ids = torch.tensor([[1, 5, 9, 200, 17, 3, 8]])  # 7 rows per linear call
    monkeypatch.setattr(transposed_gemm, "MAX_ROWS", 6)
    calls = count_calls(monkeypatch, transposed_gemm, "transposed_linear")
    with torch.no_grad():
        ref = model(ids).logits
        with transposed_linears(model) as switched:
            assert switched
            out = model(ids).logits
            assert not calls  # 7 rows > MAX_ROWS: F.linear
            model(ids[:, :6])
            assert len(calls) == linear_count(model)  # 6 rows: the transposed layout
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_untied_head_with_bias_and_lora_models_use_the_lever(tiny):
    _, tokenizer = tiny
    config = tiny_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).eval()
    model.lm_head.bias = torch.nn.Parameter(torch.randn(config.vocab_size))
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        ref = model(ids).logits
        with transposed_linears(model) as switched:
            out = model(ids).logits
    assert model.lm_head in switched
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    before = linear_count(model)
    peft_model = apply_lora(model, rank=4, alpha=8)  # adapters on the decoder's linears: base layers, A and B are plain
    with torch.no_grad(), transposed_linears(peft_model) as switched:
        assert model.lm_head in switched and len(switched) == linear_count(peft_model) > before
        assert not any(type(m).__module__.startswith("peft") for m in switched)
        torch.testing.assert_close(peft_model(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-5)
    assert not any("forward" in vars(m) for m in peft_model.modules())


def test_linears_that_are_not_plain_fp32_keep_their_forward(tiny):
    model, _ = tiny
    torch.manual_seed(2)
    lora_on_head = apply_lora(load_model("tiny")[0], rank=4, alpha=8, target_modules=["lm_head"])
    assert not transposable(output_head(lora_on_head))
    with transposed_linears(lora_on_head) as switched:
        assert output_head(lora_on_head) not in switched
        assert output_head(lora_on_head).base_layer in switched  # the wrapper's plain linear is
    with torch.autocast("cpu", dtype=torch.bfloat16), transposed_linears(model) as switched:
        assert not switched
    with transposed_linears(model, enabled=False) as switched:
        assert not switched
    bf16 = torch.nn.Linear(4, 3).to(torch.bfloat16)
    assert not transposable(bf16)
    assert not any("forward" in vars(m) for m in model.modules())


# ---------------------------------------------------------------------------- growing KV cache
def test_growing_layer_holds_what_cat_holds_through_reorder_crop_and_select():
    torch.manual_seed(0)
    ref, grow = DynamicLayer(), None
    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    ref.update(k, v)
    grow = GrowingLayer.from_tensors(k, v, capacity=7)
    for step in range(6):  # 7 columns of room, then a regrowth
        k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
        rk, rv = ref.update(k, v)
        gk, gv = grow.update(k, v)
        assert torch.equal(gk, rk) and torch.equal(gv, rv)
    assert grow._owns_views()
    index = torch.tensor([1, 0, 1])
    ref.reorder_cache(index)
    grow.reorder_cache(index)
    assert torch.equal(grow.keys, ref.keys) and grow._owns_views() and grow._key_buffer.shape[0] == 3
    ref.crop(-2)
    grow.crop(-2)
    ref.batch_select_indices(torch.tensor([0, 2]))
    grow.batch_select_indices(torch.tensor([0, 2]))
    k, v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    rk, rv = ref.update(k, v)
    gk, gv = grow.update(k, v)
    assert torch.equal(gk, rk) and torch.equal(gv, rv) and grow.get_seq_length() == ref.get_seq_length()


def test_growing_layer_defers_the_row_copy_until_the_columns_are_read():
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    ref, grow = DynamicLayer(), GrowingLayer.from_tensors(k, v, capacity=9)
    ref.update(k, v)
    first, second = torch.tensor([1, 0, 1, 1]), torch.tensor([3, 0, 2])
    ref.reorder_cache(first)
    grow.reorder_cache(first)
    assert grow.deferred and grow.get_seq_length() == 5 and grow.filled_views()[0].shape == (4, 3, 5, 4)
    ref.reorder_cache(second)
    grow.reorder_cache(second)  # nothing written in between: the two row maps compose, still nothing copied
    assert grow.deferred and grow._key_buffer.shape == (3, 3, 9, 4)
    for _ in range(6):  # writes stay deferred-safe, through a regrowth (which copies the prefix first)
        k, v = torch.randn(3, 3, 1, 4), torch.randn(3, 3, 1, 4)
        ref.update(k, v)
        grow.write(k, v)
    assert not grow.deferred  # the regrowth at column 9 had to read the filled columns
    assert torch.equal(grow.keys, ref.keys) and torch.equal(grow.values, ref.values)

    grow = GrowingLayer.from_tensors(ref.keys, ref.values, capacity=20)
    ref.reorder_cache(torch.tensor([2, 2]))
    grow.reorder_cache(torch.tensor([2, 2]))
    k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    ref.update(k, v)
    grow.write(k, v)
    assert grow.deferred and torch.equal(grow.filled_views()[0][:, :, -1:], k)  # new columns written, prefix not yet
    grow.reorder_cache(torch.tensor([1]))  # a column was written since: the first copy is done, then deferred again
    ref.reorder_cache(torch.tensor([1]))
    assert grow.deferred
    rk, rv = ref.update(k[:1], v[:1])
    gk, gv = grow.update(k[:1], v[:1])  # update returns the filled columns: the copy is done
    assert not grow.deferred and torch.equal(gk, rk) and torch.equal(gv, rv)
    grow.reorder_cache(torch.tensor([0, 0]))
    grow.reset()
    assert not grow.deferred and grow.get_seq_length() == 0


def test_growing_layer_falls_back_to_cat_under_autograd():
    k = torch.randn(1, 2, 3, 4, requires_grad=True)
    layer = GrowingLayer.from_tensors(k.detach(), k.detach(), capacity=8)
    keys, _ = layer.update(k, k)
    keys.sum().backward()
    assert torch.equal(k.grad, torch.ones_like(k))


def test_growing_layer_does_a_deferred_copy_before_falling_back_to_cat():
    torch.manual_seed(0)
    k = torch.randn(2, 2, 3, 4)
    layer = GrowingLayer.from_tensors(k, k, capacity=8)
    layer.reorder_cache(torch.tensor([1, 0, 1]))
    x = torch.randn(3, 2, 1, 4, requires_grad=True)
    keys, values = layer.update(x, x)
    assert torch.equal(keys[:, :, :3], k[[1, 0, 1]]) and torch.equal(values[:, :, 3:], x)


def test_make_growing_leaves_other_layer_types_alone(tiny):
    model, _ = tiny
    with torch.no_grad():
        cache = output_cache(model(torch.tensor([[1, 2, 3]]), use_cache=True))
    assert isinstance(cache, DynamicCache)
    make_growing(cache, 10)
    assert all(type(layer) is GrowingLayer for layer in cache.layers)
    assert cache.get_seq_length() == 3 and cache.layers[0]._key_buffer.shape[2] == 10


def test_kept_caches_between_turns_give_the_same_tokens_with_a_growing_cache(tiny):
    model, tokenizer = tiny
    first = prompts(tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, do_sample=True)
    outs = {}
    for grow in (False, True):
        backend = HFBackend(model, tokenizer, precision="fp32", grow_cache=grow)
        torch.manual_seed(0)
        with backend.prefix_cache.session():
            turn1 = backend.generate(first, params)
            second = [p + g.token_ids + tokenizer("next turn")["input_ids"] for p, g in zip(first, turn1)]
            turn2 = backend.generate(second, params)
            assert backend.stats.reused_tokens > 0  # the second turn resumed from kept caches
        outs[grow] = [g.token_ids for g in turn1 + turn2]
    assert outs[True] == outs[False]
