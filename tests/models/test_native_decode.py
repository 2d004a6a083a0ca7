"""The C++ grouped decode step computes what the Python fused step computes, up to float rounding."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from ragen.models import native
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.cache_names import with_cache
from ragen.models.fused_decode import _rms_norm, decode_step
from ragen.models.fused_weights import FusedWeights
from ragen.models.shared_prefix import OWN_CHUNK, SharedPrefix
from ragen.models.growing_cache import GrowingLayer, make_growing

from tests.models.small_models import SMALL, small_model

OPS = native.ops()
needs_native = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart ``a`` and ``b`` (bf16, same sign, finite) are."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@needs_native
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), width=st.integers(1, 200), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_rms_norm_kernel_is_the_python_norm_to_one_bf16_step(rows, width, scale, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, width, generator=g) * scale
    w = torch.randn(width, generator=g)
    h_before = h.clone()
    got = OPS.rms_norm_bf16(h, w, 1e-5)
    expected = _rms_norm(h, w, 1e-5).to(torch.bfloat16)
    assert torch.equal(h, h_before)  # the op works on a copy
    assert got.dtype == torch.bfloat16 and got.shape == (rows, width)
    # the mean of squares is summed in another order than ATen's: the bf16 result may round one step apart, rarely
    assert bf16_ulps(got, expected).max() <= 1
    assert (got != expected).sum() <= max(1, 0.01 * got.numel())


@needs_native
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), inter=st.integers(1, 300), scale=st.floats(0.01, 30.0), seed=st.integers(0, 2**16))
def test_silu_mul_kernel_is_silu_times_up_in_bf16(rows, inter, scale, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * scale).bfloat16()
    got = OPS.silu_mul_bf16(gate_up)
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    # exp within ~2 ulp of fp32 before the bf16 rounding: at most one bf16 step apart, and rarely that
    assert (got.float() - expected.float()).abs().le(expected.float().abs() * 2 ** -7 + 1e-30).all()
    assert (got != expected).sum() <= max(1, 0.01 * got.numel())


@needs_native
def test_silu_mul_kernel_edge_values():
    z = torch.tensor([0.0, -0.0, 1e-30, -100.0, 100.0, -88.5, 89.0, float("inf"), float("-inf"), float("nan")])
    gate_up = torch.cat([z, torch.ones_like(z)]).bfloat16()[None]
    got, expected = OPS.silu_mul_bf16(gate_up)[0].float(), (F.silu(gate_up[:, :10]) * gate_up[:, 10:])[0].float()
    assert torch.equal(got.isnan(), expected.isnan())
    torch.testing.assert_close(got[~got.isnan()], expected[~expected.isnan()], rtol=2 ** -7, atol=0)


#: head_dim 14, widths not multiples of 16 (the kernels' masked and scalar tails); head_dim 80 in two KV heads of two
#: query heads (the attention's output in chunks of 64 columns, the second one partial)
ODD = dict(SMALL, hidden_size=84, intermediate_size=100)
WIDE = dict(SMALL, hidden_size=320, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)


def odd_model(seed: int = 0, config=ODD):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def grouped_run(model, ids, mask, group: int, steps: int, dtype: torch.dtype, ops, tokens=None, room=None,
                positions_given: bool = True):
    """Prefill ``U`` prompts, copy each to ``group`` rows, then ``steps`` fused decode steps with a shared prefix.

    Returns each step's logits ``(B, V)`` fp32, the tokens fed, the cache and the prefix. ``tokens`` (one ``(B, 1)``
    per step) are fed if given, else each step's argmax. ``room``: the cache's spare columns (default: all steps);
    without ``positions_given`` the steps pass no positions (every row at the cache's length, one cos row)."""
    U, W = ids.shape
    rows = torch.arange(U).repeat_interleave(group)
    bf16 = dtype == torch.bfloat16
    out, fed = [], []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True, **with_cache(cache))
        make_growing(cache, W + (steps + 2 if room is None else room))
        padding = mask[:, :-1] == 0
        prefix = SharedPrefix.from_layers(cache.layers, group, padding=padding, capacity=steps)
        cache.reorder_cache(rows)
        weights = FusedWeights(model, dtype)
        m = mask[rows]
        token = ids[rows, -1:]
        positions = m.sum(1, keepdim=True) - 1
        for step in range(steps):
            logits = decode_step(model, weights, token, m, positions if positions_given else None, cache, prefix,
                                 native=ops)[:, 0].float()
            out.append(logits)
            fed.append(token)
            token = tokens[step + 1] if tokens is not None and step + 1 < len(tokens) else logits.argmax(-1, keepdim=True)
            m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
            positions = positions + 1
    return out, fed, cache, prefix


def prompts(vocab: int, seed: int = 0, pads=(0, 3, 5)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (len(pads), 11), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids, mask


@needs_native
@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_bias", "odd", "wide"])
@pytest.mark.parametrize("group,pads", [(3, (0, 3, 5)), (4, (0, 0)), (1, (2, 0, 0, 1))])
def test_native_steps_are_as_close_to_fp32_as_the_python_steps(kind, group, pads):
    model = odd_model(3) if kind == "odd" else odd_model(3, WIDE) if kind == "wide" else small_model(kind, seed=3)
    ids, mask = prompts(model.config.vocab_size, seed=group, pads=pads)
    steps = 5
    exact, tokens, _, _ = grouped_run(model, ids, mask, group, steps, torch.float32, None)
    python, _, py_cache, py_prefix = grouped_run(model, ids, mask, group, steps, torch.bfloat16, None, tokens)
    ported, _, nat_cache, nat_prefix = grouped_run(model, ids, mask, group, steps, torch.bfloat16, OPS, tokens)
    assert nat_prefix.native_steps == steps and py_prefix.native_steps == 0
    assert nat_prefix.own_steps == py_prefix.own_steps == steps
    # the first step starts from the same prefilled state: the same logits up to the kernels' rounding
    scale = python[0].abs().max()
    assert (ported[0] - python[0]).abs().max() <= 0.02 * scale, ((ported[0] - python[0]).abs().max(), scale)
    for step in range(steps):
        py_err, nat_err = (python[step] - exact[step]).abs(), (ported[step] - exact[step]).abs()
        assert nat_err.max() <= 2 * py_err.max() + 1e-3 and nat_err.mean() <= 2 * py_err.mean() + 1e-4, \
            (step, nat_err.max(), py_err.max(), nat_err.mean(), py_err.mean())
    # the caches: the same columns, the step's keys (fp32) and values (bf16) as the Python step wrote them
    for nat, py in zip(nat_cache.layers, py_cache.layers):
        assert type(nat) is GrowingLayer and nat.keys.shape == py.keys.shape and nat.values.dtype == torch.bfloat16
        torch.testing.assert_close(nat.keys, py.keys, rtol=0.05, atol=0.05)
        torch.testing.assert_close(nat.values.float(), py.values.float(), rtol=0.05, atol=0.05)
    n = nat_prefix.length + steps * group  # the group buffers' filled columns
    for a, b in zip(nat_prefix.keys_t, py_prefix.keys_t):
        torch.testing.assert_close(a[..., :n], b[..., :n], rtol=0.05, atol=0.05)
    for a, b in zip(nat_prefix.values, py_prefix.values):
        torch.testing.assert_close(a[:, :, :n], b[:, :, :n], rtol=0.05, atol=0.05)


@needs_native
def test_a_native_step_writes_the_cache_column_the_python_step_writes():
    model = small_model("llama", seed=5)
    ids, mask = prompts(model.config.vocab_size, seed=5)
    _, tokens, _, _ = grouped_run(model, ids, mask, 3, 1, torch.float32, None)
    _, _, py_cache, py_prefix = grouped_run(model, ids, mask, 3, 1, torch.bfloat16, None, tokens)
    _, _, nat_cache, nat_prefix = grouped_run(model, ids, mask, 3, 1, torch.bfloat16, OPS, tokens)
    for nat, py in zip(nat_cache.layers, py_cache.layers):
        # the prefilled columns untouched, the new one the rotated key (fp32) and the value (bf16)
        assert torch.equal(nat.keys[:, :, :-1], py.keys[:, :, :-1]) and torch.equal(nat.values[:, :, :-1], py.values[:, :, :-1])
        torch.testing.assert_close(nat.keys[:, :, -1], py.keys[:, :, -1], rtol=0.02, atol=0.02)
        assert bf16_ulps(nat.values[:, :, -1], py.values[:, :, -1]).max() <= 2
    L, k = nat_prefix.length, nat_prefix.group
    for a, b in zip(nat_prefix.keys_t, py_prefix.keys_t):
        assert torch.equal(a[..., :L], b[..., :L])
        torch.testing.assert_close(a[..., L : L + k], b[..., L : L + k], rtol=0.02, atol=0.02)


@needs_native
def test_native_step_catches_buffers_that_do_not_fit():
    model = small_model("llama", seed=1)
    ids, mask = prompts(model.config.vocab_size, seed=1)
    _, _, cache, prefix = grouped_run(model, ids, mask, 3, 1, torch.bfloat16, OPS)
    weights = FusedWeights(model, torch.bfloat16)
    L = weights.layers
    H, H_kv = model.config.num_attention_heads, model.config.num_key_value_heads
    B, C = 9, model.config.hidden_size
    D = C // H
    args = dict(cos=torch.ones(1, 1, D), sin=torch.zeros(1, 1, D))
    with pytest.raises(RuntimeError, match="KV cache must hold fp32 keys and bf16 values"):
        OPS.decode_grouped(torch.zeros(B, C), args["cos"], args["sin"], [w.norm_in for w in L], [w.eps_in for w in L],
                           [w.qkv.weight for w in L], [w.qkv.bias for w in L], [w.o.weight for w in L],
                           [w.o.bias for w in L], [w.norm_post for w in L], [w.eps_post for w in L],
                           [w.gate_up.weight for w in L], [w.down.weight for w in L], prefix.keys_t, prefix.values,
                           [layer._key_buffer.bfloat16() for layer in cache.layers],
                           [layer._value_buffer for layer in cache.layers], prefix.grouped_bias, 3, prefix.length,
                           cache.get_seq_length(), H, H_kv, D ** -0.5, weights.norm, weights.norm_eps, weights.head.weight)


@needs_native
def test_backend_runs_grouped_bf16_steps_natively_and_can_be_told_not_to(tiny):
    model, tokenizer = tiny
    a, b = (tokenizer(t)["input_ids"] for t in ("push the box", "the box is on the target now"))
    params = SamplingParams(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    on = HFBackend(model, tokenizer, precision="bf16")
    off = HFBackend(model, tokenizer, precision="bf16", native_decode=False)
    got = on.generate([a] * 4 + [b] * 4, params)
    assert on.fused.native_steps == on.fused.grouped_steps > 0
    want = off.generate([a] * 4 + [b] * 4, params)
    assert off.fused.native_steps == 0 and off.fused.grouped_steps == on.fused.grouped_steps
    assert all(len(g.token_ids) == 6 for g in got + want)
    # a random tiny model's logits are nearly flat: greedy tokens may differ in rounding, most do not
    same = sum(x == y for g, h in zip(got, want) for x, y in zip(g.token_ids, h.token_ids))
    assert same >= 0.75 * 8 * 6, same


@needs_native
def test_resumed_turns_decode_natively_as_groups_of_one(tiny):
    """Turn 2 resumes each row's kept cache (no prompt shared): its steps run in C++ as groups of one and sample what
    the Python step samples, up to bf16 rounding; the kept entries cover the turn's native columns too."""
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    torch.manual_seed(2)
    prompts = [torch.randint(10, 1000, (n,)).tolist() for n in (12, 20, 7, 15)]
    runs = {}
    for on in (True, False):
        backend = HFBackend(model, tokenizer, precision="bf16", native_decode=on)
        with backend.session():
            first = backend.generate(prompts, params)
            turn1_native = backend.fused.native_steps
            again = [p + g.token_ids + [5, 6, 7][: i + 1] for i, (p, g) in enumerate(zip(prompts, first))]
            second = backend.generate(again, params)
            assert backend.stats.reused_tokens > 0
            third = [p + g.token_ids + [9] for p, g in zip(again, second)]
            backend.generate(third, params)
            entries = [e for same in backend.prefix_cache._entries.values() for e in same]
        runs[on] = [g.token_ids for g in first + second], turn1_native, backend.fused.native_steps - turn1_native, \
            entries, third
    (got, turn1_native, native_steps, entries, third), (want, _, python_steps, _, _) = runs[True], runs[False]
    assert turn1_native == 0  # four distinct prompts: turn 1 has no group to share
    assert native_steps >= 2 * (6 - 1) and python_steps == 0  # turns 2 and 3: every step after the prefill's token
    assert sorted(len(e) for e in entries) == sorted(len(p) + 6 - 1 for p in third)  # turn 3's caches were kept whole
    # a random tiny model's logits are nearly flat: greedy tokens may differ in rounding, most do not
    same = sum(x == y for g, h in zip(got, want) for x, y in zip(g, h))
    assert same >= 0.75 * 8 * 6, same

    bounded = HFBackend(model, tokenizer, precision="bf16")
    with bounded.session():
        first = bounded.generate(prompts, params)
        bounded.prefix_cache.max_bytes = bounded.prefix_cache.nbytes  # the kept caches fit; their fp32 copy would not
        bounded.generate([p + g.token_ids + [5] for p, g in zip(prompts, first)], params)
        assert bounded.stats.reused_tokens > 0 and bounded.fused.native_steps == 0  # decoded in Python, as before


@needs_native
def test_resumed_turns_make_no_prefix_copy_the_kernel_would_not_read(tiny, monkeypatch):
    """After the kernel refused a step (every later step runs in Python) or with own columns read per row, a resumed
    turn records no group-of-one prefix: the fp32 copy would serve no C++ step."""
    from ragen.models import native_decode

    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    prompts = [[11, 12, 13, 14], [21, 22, 23, 24, 25, 26], [31, 32, 33]]
    recorded = []
    real = SharedPrefix.from_layers.__func__
    monkeypatch.setattr(SharedPrefix, "from_layers", classmethod(lambda cls, *a, **k: recorded.append(a[1]) or real(cls, *a, **k)))
    for case in ("failed", "own columns per row"):
        backend = HFBackend(model, tokenizer, precision="bf16")
        with backend.session():
            first = backend.generate(prompts, params)
            with monkeypatch.context() as patch:
                if case == "failed":
                    patch.setattr(native_decode, "failed", "simulated refusal")
                else:
                    backend.fused.group_own_columns = False
                recorded.clear()
                backend.generate([p + g.token_ids + [7] for p, g in zip(prompts, first)], params)
            assert backend.stats.reused_tokens > 0 and recorded == [], case


def test_a_failed_build_warns_once_and_leaves_the_python_path(monkeypatch, tmp_path):
    broken = tmp_path / "broken_step.cpp"
    broken.write_text("this is not C++\n")
    library = native.NativeLibrary("ragen_test_broken", broken, ("avx2",), "decode_grouped", "native decode kernels")
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setenv("RAGEN_NATIVE_DIR", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="native decode kernels unavailable") as caught:
        assert library.ops() is None
        assert library.ops() is None  # tried once: no second build, no second warning
    assert len(caught) == 1
    assert "broken_step.cpp failed" in native.unavailable_reason(library)
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built is kept


@pytest.mark.parametrize("library, missing", [(native.DECODE, "avx512_bf16"), (native.GEMM, "fma")])
def test_cpus_without_the_kernels_extensions_are_not_tried(monkeypatch, library, missing):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw", "avx512vl"}))
    monkeypatch.setattr(library, "reason", library.reason)  # restored after the test
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert library.load() is None
    assert native.unavailable_reason(library) == f"this CPU lacks {missing}"


def test_native_off_is_not_tried(monkeypatch):
    monkeypatch.setenv("RAGEN_NATIVE", "0")
    library = native.NativeLibrary("ragen_test_off", native.GEMM.source, (), "linear_panels", "x")
    assert library.load() is None and library.reason == "RAGEN_NATIVE=0"


@pytest.mark.parametrize("library", [native.DECODE, native.GEMM])
def test_the_library_key_follows_the_source(monkeypatch, tmp_path, library):
    first = library.key()
    changed = tmp_path / library.source.name
    changed.write_bytes(library.source.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(library, "source", changed)
    assert library.key() != first


@needs_native
def test_heads_wider_than_the_kernel_takes_decode_in_python(monkeypatch):
    from ragen.models import native_decode

    model = small_model("llama", seed=4)
    ids, mask = prompts(model.config.vocab_size, seed=4)
    monkeypatch.setattr(native_decode, "MAX_HEAD_DIM", 8)  # the small model's heads are 16 wide
    ported, tokens, _, prefix = grouped_run(model, ids, mask, 3, 2, torch.bfloat16, OPS)
    python, _, _, _ = grouped_run(model, ids, mask, 3, 2, torch.bfloat16, None, tokens)
    assert prefix.native_steps == 0 and prefix.own_steps == 2  # grouped steps, in Python
    assert all(torch.equal(a, b) for a, b in zip(ported, python))


@needs_native
@pytest.mark.parametrize("positions_given", [True, False])
def test_native_steps_through_buffer_growth(positions_given):
    """More steps than a group buffer's first chunk (OWN_CHUNK) and a cache with two spare columns: both regrow
    between native steps, and the kernel must get the new buffers."""
    model = small_model("qwen2", seed=6)
    pads = (0, 3, 5) if positions_given else (0, 0, 0)  # no positions: rows at the cache's length, so no padding
    ids, mask = prompts(model.config.vocab_size, seed=6, pads=pads)
    steps = OWN_CHUNK + 6
    exact, tokens, _, _ = grouped_run(model, ids, mask, 3, steps, torch.float32, None, positions_given=positions_given)
    python, _, py_cache, _ = grouped_run(model, ids, mask, 3, steps, torch.bfloat16, None, tokens, room=2,
                                         positions_given=positions_given)
    ported, _, nat_cache, nat_prefix = grouped_run(model, ids, mask, 3, steps, torch.bfloat16, OPS, tokens, room=2,
                                                   positions_given=positions_given)
    assert nat_prefix.native_steps == steps and nat_prefix.keys_t[0].shape[-1] > nat_prefix.length + OWN_CHUNK * 3
    assert nat_cache.layers[0]._key_buffer.shape[-2] > ids.shape[1] + 2  # the cache regrew
    for step in range(steps):
        py_err, nat_err = (python[step] - exact[step]).abs(), (ported[step] - exact[step]).abs()
        assert nat_err.max() <= 2 * py_err.max() + 1e-3 and nat_err.mean() <= 2 * py_err.mean() + 1e-4, step
    for nat, py in zip(nat_cache.layers, py_cache.layers):
        assert nat.keys.shape == py.keys.shape
        torch.testing.assert_close(nat.keys, py.keys, rtol=0.05, atol=0.05)


@needs_native
def test_a_step_the_kernel_refuses_runs_in_python_with_one_warning(monkeypatch):
    from ragen.models import native_decode

    class Refusing:
        calls = 0

        def decode_grouped(self, *args):
            Refusing.calls += 1
            raise RuntimeError("cache values must be bf16\nmore detail")

    monkeypatch.setattr(native_decode, "failed", None)
    model = small_model("llama", seed=7)
    ids, mask = prompts(model.config.vocab_size, seed=7)
    python, tokens, _, _ = grouped_run(model, ids, mask, 3, 3, torch.bfloat16, None)
    with pytest.warns(UserWarning, match="native decode step failed") as caught:
        refused, _, _, prefix = grouped_run(model, ids, mask, 3, 3, torch.bfloat16, Refusing(), tokens)
    assert len([w for w in caught if "native decode" in str(w.message)]) == 1 and Refusing.calls == 1
    assert native_decode.failed == "cache values must be bf16"
    assert prefix.native_steps == 0 and prefix.own_steps == 3
    assert all(torch.equal(a, b) for a, b in zip(refused, python))  # the Python step, as if the kernel were off
