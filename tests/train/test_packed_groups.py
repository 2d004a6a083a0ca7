"""The packed shared-prompt layout (one decoder row per group under a block mask) gives the plain pass's numbers.

Speed never changes results. ``decoder_hidden`` with ``layout="packed"`` must match the plain
pass (every row on its own) and the split layout in log-probs, entropy and every parameter's gradient; ``"auto"``
must really take the layout it picks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragen.train.logprobs import decoder_hidden, policy_forward
from ragen.train.packed_groups import (PASS_OVERHEAD_TOKENS, block_mask, group_widths, pack_groups,
                                       packed_is_cheaper, packing_supported, pair_cost_in_tokens)


def grouped_batch(vocab: int, groups: list[list[tuple[int, int]]], seed: int = 0):
    """A right-padded batch whose groups share a prompt: ``groups[g]`` lists ``(prompt_len, continuation_len)``
    per row (one prompt length per group). Returns ids, attention mask, response mask, prompt lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for members in groups:
        prompt = torch.randint(3, vocab, (members[0][0],), generator=g)
        rows += [(prompt, torch.randint(3, vocab, (s,), generator=g)) for _, s in members]
    L = max(len(p) + len(c) for p, c in rows)
    B = len(rows)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    response = torch.zeros(B, L - 1)
    plens = torch.zeros(B, dtype=torch.long)
    for r, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        ids[r, :n] = torch.cat([p, c])
        mask[r, :n] = 1
        response[r, len(p) - 1 : n - 1] = 1
        plens[r] = len(p)
    return ids, mask, response, plens


# three groups: sizes 3, 2, 1; different prompt lengths; one row with no continuation at all
GROUPS = [[(8, 12), (8, 6), (8, 0)], [(5, 7), (5, 12)], [(6, 3)]]


def forward_and_grads(model, ids, mask, response, plens, layout, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = policy_forward(model, ids, mask, response, with_entropy=True, entropy_grad=False,
                             prompt_lengths=plens, prompt_layout=layout)
    (out.logprobs * response).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), out.entropy.detach(), grads


@pytest.mark.parametrize("autocast, tol", [(False, 1e-5), (True, 3e-2)])
def test_packed_layout_equals_the_plain_and_split_passes(tiny, autocast, tol):
    model, _ = tiny
    ids, mask, response, plens = grouped_batch(model.config.vocab_size, GROUPS)
    plain = forward_and_grads(model, ids, mask, response, None, "auto", autocast)
    for layout in ("packed", "split"):
        logp, ent, grads = forward_and_grads(model, ids, mask, response, plens, layout, autocast)
        torch.testing.assert_close(logp, plain[0], rtol=tol, atol=tol)
        torch.testing.assert_close(ent, plain[1], rtol=tol, atol=tol)
        assert grads.keys() == plain[2].keys()
        for name, grad in plain[2].items():
            assert (grads[name] - grad).norm() <= tol * grad.norm() + 1e-8, (layout, name)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 9), st.lists(st.integers(0, 10), min_size=1, max_size=4)), min_size=1, max_size=4))
def test_packed_hidden_states_equal_the_plain_pass_for_any_grouping(tiny, spec):
    """Any group sizes, prompt and continuation lengths: the packed layout's hidden states are the plain pass's at
    every real position and zero past each row's end."""
    model, _ = tiny
    groups = [[(p, s) for s in conts] for p, conts in spec]
    ids, mask, _, plens = grouped_batch(model.config.vocab_size, groups, seed=len(spec))
    with torch.no_grad():
        packed = decoder_hidden(model, ids, mask, plens, layout="packed")
        plain = decoder_hidden(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(packed[real], plain[real], rtol=1e-5, atol=1e-5)
    assert packed[~real].abs().max().item() == 0.0 if (~real).any() else True


def test_eager_attention_gets_an_additive_mask_with_the_same_result(tiny):
    model, _ = tiny
    ids, mask, _, plens = grouped_batch(model.config.vocab_size, GROUPS)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            packed = decoder_hidden(model, ids, mask, plens, layout="packed")
            plain = decoder_hidden(model, ids, mask)
    finally:
        model.set_attn_implementation("sdpa")
    real = mask.bool()
    torch.testing.assert_close(packed[real], plain[real], rtol=1e-5, atol=1e-5)


def test_block_mask_lets_a_continuation_read_its_prompt_and_itself_only():
    segments = torch.tensor([[0, 0, 1, 1, 2, -1]])  # prompt of 2, continuations of 2 and 1, one padding slot
    allowed = block_mask(segments, "sdpa")[0, 0].int()
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # the second continuation skips the first
        [1, 1, 0, 0, 0, 0],  # padding reads the prompt: never a fully masked row
    ])
    assert torch.equal(allowed, expected)
    additive = block_mask(segments, "eager")[0, 0]
    assert torch.equal(additive == 0, expected.bool())
    assert (additive[~expected.bool()] == torch.finfo(torch.float32).min).all()


def test_pack_groups_places_each_continuation_after_its_prompt_with_its_own_positions():
    ids = torch.tensor([[7, 8, 1, 2, 3], [7, 8, 4, 0, 0], [9, 5, 0, 0, 0]])  # (B, L) right-padded
    packing = pack_groups(ids, lengths=[5, 3, 2], prompt_lengths=[2, 2, 1], row_group=[0, 0, 1], group_count=2, pad_id=0)
    assert packing.input_ids.tolist() == [[7, 8, 1, 2, 3, 4], [9, 5, 0, 0, 0, 0]]
    assert packing.position_ids.tolist() == [[0, 1, 2, 3, 4, 2], [0, 1, 0, 0, 0, 0]]
    assert packing.segments.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, -1, -1, -1, -1]]
    T = 6
    assert packing.gather[0].tolist() == [0, 1, 2, 3, 4]
    assert packing.gather[1, :3].tolist() == [0, 1, 5]
    assert packing.gather[2, :2].tolist() == [T + 0, T + 1]
    assert group_widths([5, 3, 2], [2, 2, 1], [0, 0, 1], 2) == [6, 2]


def test_the_cost_rule_packs_short_answers_and_splits_long_continuations(tiny):
    """The two regimes measured in docs/performance.md: the main job's 4 rows × ≤ 16 tokens on ~110-token prompts
    (packed), bench_vs_trl's 8 rows × 64 tokens on ~108 (split), and multi-turn rows of ~600 tokens (split)."""
    model, _ = tiny
    cost = 4 * 9 * 64 * 4.0 / (2 * 3_540_000)  # SmolLM2-135M's: 9 heads of 64, 3.54 M weights per layer

    def rule(G, per_group, P, S):
        lengths = [P + S] * (G * per_group)
        return packed_is_cheaper(lengths, [P] * len(lengths), [r // per_group for r in range(len(lengths))], G, cost)

    assert rule(4, 4, 110, 8) and rule(4, 4, 110, 16)
    assert not rule(2, 8, 108, 64)
    assert not rule(2, 4, 200, 600)
    decoder = model.get_decoder()
    layer = sum(p.numel() for p in decoder.layers[0].parameters())
    c = decoder.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    assert pair_cost_in_tokens(decoder) == pytest.approx(4 * c.num_attention_heads * head_dim * 4.0 / (2 * layer))
    # without attention costs: 15 packed tokens against 5 + 2 x 5 + the second pass's overhead
    assert packed_is_cheaper([10, 10], [5, 5], [0, 0], 1, 0.0)
    # one group, 2 rows: packed T = 5 + 5 + 5 = 15 -> 15 + 225c; split 5 + 10 + (25 + 2 x 5 x 10)c + overhead
    c = (PASS_OVERHEAD_TOKENS + (5 + 10) - 15) / (225 - 125) + 0.01  # just past the break-even pair cost
    assert not packed_is_cheaper([10, 10], [5, 5], [0, 0], 1, c)


def count_decoder_calls(model, fn):
    calls = []
    handle = model.get_decoder().register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        fn()
    finally:
        handle.remove()
    return len(calls)


def test_auto_takes_the_layout_the_rule_picks(tiny, monkeypatch):
    import ragen.train.logprobs as logprobs

    model, _ = tiny
    ids, mask, _, plens = grouped_batch(model.config.vocab_size, GROUPS)
    with torch.no_grad():
        for cheaper, passes in ((True, 1), (False, 2)):
            monkeypatch.setattr(logprobs, "packed_is_cheaper", lambda *a, cheaper=cheaper: cheaper)
            assert count_decoder_calls(model, lambda: decoder_hidden(model, ids, mask, plens)) == passes
        assert count_decoder_calls(model, lambda: decoder_hidden(model, ids, mask, plens, layout="split")) == 2
        assert count_decoder_calls(model, lambda: decoder_hidden(model, ids, mask, plens, layout="packed")) == 1


def test_sliding_windows_and_other_attention_keep_the_split_layout(tiny, monkeypatch):
    import ragen.train.logprobs as logprobs

    model, _ = tiny
    decoder = model.get_decoder()
    assert packing_supported(decoder, 64)
    for attr, value in (("sliding_window", 8), ("layer_types", ["sliding_attention"] * model.config.num_hidden_layers),
                        ("_attn_implementation", "flash_attention_2")):
        with monkeypatch.context() as m:
            m.setattr(decoder.config, attr, value, raising=False)
            assert not packing_supported(decoder, 20), attr
    with monkeypatch.context() as m:  # a window no packed row reaches does not matter
        m.setattr(decoder.config, "sliding_window", 4096, raising=False)
        assert packing_supported(decoder, 20)
    ids, mask, _, plens = grouped_batch(model.config.vocab_size, GROUPS)
    monkeypatch.setattr(logprobs, "packed_is_cheaper", lambda *a: True)
    monkeypatch.setattr(logprobs, "packing_supported", lambda *a: False)
    with torch.no_grad():
        assert count_decoder_calls(model, lambda: decoder_hidden(model, ids, mask, plens)) == 2
        with pytest.raises(ValueError, match="packed layout"):
            decoder_hidden(model, ids, mask, plens, layout="packed")


def test_identical_prompts_in_two_groups_share_one_packed_row(tiny):
    """Two groups (different seeds) can render the same prompt; rows are grouped by the prompt's tokens."""
    model, _ = tiny
    ids, mask, response, plens = grouped_batch(model.config.vocab_size, [[(6, 4), (6, 7)], [(6, 5)]])
    ids[2, :6] = ids[0, :6]
    plain = forward_and_grads(model, ids, mask, response, None, "auto")
    packed = forward_and_grads(model, ids, mask, response, plens, "packed")
    torch.testing.assert_close(packed[0], plain[0], rtol=1e-5, atol=1e-5)
    calls = []
    handle = model.get_decoder().register_forward_pre_hook(lambda module, args, kw: calls.append(kw["input_ids"].shape),
                                                           with_kwargs=True)
    try:
        with torch.no_grad():
            decoder_hidden(model, ids, mask, plens, layout="packed")
    finally:
        handle.remove()
    assert calls == [torch.Size([1, 6 + 4 + 7 + 5])]


def test_shared_prompt_layout_names_the_choice_of_auto(tiny, monkeypatch):
    import ragen.train.logprobs as logprobs
    from ragen.train.logprobs import shared_prompt_layout

    model, _ = tiny
    ids, mask, _, plens = grouped_batch(model.config.vocab_size, GROUPS)
    assert shared_prompt_layout(model, ids, mask, None) == "split"
    for cheaper, layout in ((True, "packed"), (False, "split")):
        monkeypatch.setattr(logprobs, "packed_is_cheaper", lambda *a, cheaper=cheaper: cheaper)
        assert shared_prompt_layout(model, ids, mask, plens) == layout


def test_a_prompt_longer_than_its_row_is_a_clear_error(tiny):
    model, _ = tiny
    ids, mask, _, plens = grouped_batch(model.config.vocab_size, GROUPS)
    mask[1] = 0  # an empty row: argmax of its empty response mask gives a 1-token prompt
    plens[1] = 1
    for layout in ("split", "packed"):
        with pytest.raises(ValueError, match="row 1: a prompt of 1 tokens in a row of 0"):
            decoder_hidden(model, ids, mask, plens, layout=layout)


def test_unknown_layout_is_an_error(tiny):
    model, _ = tiny
    ids, mask, _, plens = grouped_batch(model.config.vocab_size, GROUPS)
    with pytest.raises(ValueError, match="layout must be one of"):
        decoder_hidden(model, ids, mask, plens, layout="fast")
