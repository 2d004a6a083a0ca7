"""KV caches kept between turns: a turn prefills only its new tokens, and samples exactly what a full prefill would."""

import pytest
import torch

from ragen.agent import AgentConfig, Rollout
from ragen.envs.registry import make
from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.cache_names import output_cache, with_cache
from ragen.models.growing_cache import GrowingLayer
from ragen.models.prefix_cache import CachedPrefix, PrefixKVCache
from tests.models.rollouts import play


def entry(tokens, length_marker=0.0):
    keys = [torch.full((2, len(tokens), 4), length_marker)]
    return CachedPrefix(tuple(tokens), keys, [k.clone() for k in keys])


def test_take_returns_the_longest_stored_prefix_once():
    kept = PrefixKVCache()
    with kept.session():
        kept.put(entry([1, 2]))
        kept.put(entry([1, 2, 3, 4]))
        kept.put(entry([9, 9, 9]))
        assert len(kept) == 3
        assert kept.take([1, 2, 3, 4, 5]).token_ids == (1, 2, 3, 4)
        assert kept.take([1, 2, 3, 4, 5]).token_ids == (1, 2)  # the longer one was used up
        assert kept.take([1, 2, 3, 4, 5]) is None
        assert kept.take([9, 9]) is None  # an entry longer than the prompt is no prefix of it
        assert len(kept) == 1


def test_twin_rows_keep_one_entry_each():
    kept = PrefixKVCache()
    with kept.session():
        kept.put(entry([5, 6]))
        kept.put(entry([5, 6]))
        assert kept.take([5, 6, 7]) is not None and kept.take([5, 6, 7]) is not None
        assert kept.take([5, 6, 7]) is None


def test_entries_live_only_inside_an_enabled_session():
    kept = PrefixKVCache()
    kept.put(entry([1, 2]))  # no session: not kept
    assert len(kept) == 0
    with kept.session(enabled=False):
        kept.put(entry([1, 2]))
        assert len(kept) == 0 and kept.take([1, 2, 3]) is None
    with kept.session():
        kept.put(entry([1, 2]))
        assert len(kept) == 1
    assert len(kept) == 0  # cleared on exit: nothing outlives a rollout (the weights change after it)


def test_a_budget_refuses_entries_that_do_not_fit_and_a_released_take_frees_their_bytes():
    size = entry([1, 2]).nbytes  # keys and values of two tokens: 2 * (2 * 2 * 4) floats
    assert size == 2 * 2 * 2 * 4 * 4
    kept = PrefixKVCache(max_bytes=2 * size)
    with kept.session():
        kept.put(entry([1, 2]))
        kept.put(entry([3, 4]))
        assert kept.nbytes == 2 * size and kept.fits(0) and not kept.fits(1)
        kept.put(entry([5, 6]))  # over the budget: not kept
        assert len(kept) == 2 and kept.refused == 1 and kept.take([5, 6, 7]) is None
        taken = kept.take([1, 2, 9])
        assert taken is not None and kept.nbytes == size and kept.held == size
        kept.put(entry([5, 6]))  # the taken entry is still in memory: no room yet
        assert len(kept) == 1 and kept.refused == 2
        kept.release(taken.nbytes)
        kept.put(entry([5, 6]))  # room again
        assert len(kept) == 2 and kept.nbytes == 2 * size and kept.held == 0 and kept.refused == 2
    assert kept.nbytes == 0  # the session's end frees everything
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixKVCache(max_bytes=-1)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.mark.parametrize("do_sample", [False, True])
def test_rollout_with_kept_caches_plays_the_same_tokens_and_prefills_far_fewer(tiny, do_sample):
    kept_trajs, kept = play(tiny, True, do_sample=do_sample)
    # the plain arm re-encodes every prompt whole (no common-prefix sharing either)
    plain_trajs, plain = play(tiny, False, do_sample=do_sample, common_prefix=False)
    assert [t.input_ids for t in kept_trajs] == [t.input_ids for t in plain_trajs]
    assert [t.loss_mask for t in kept_trajs] == [t.loss_mask for t in plain_trajs]
    assert all(len(t.turns) == 4 for t in kept_trajs)  # the tiny model never finishes: every turn resumes a cache
    assert plain.stats.reused_tokens == 0
    assert kept.stats.reused_tokens > 0
    # turns 2-4 prefill only the reply's last token and the env's answer, not the history
    assert kept.stats.prefilled_tokens < 0.5 * plain.stats.prefilled_tokens
    assert len(kept.prefix_cache) == 0  # the session ended with the rollout


def test_a_budget_bounds_the_kept_caches_and_plays_the_same_tokens(tiny, monkeypatch):
    """Over the budget some episodes prefill their history again: same tokens, prefill work in between.

    Greedy: rows with and without a kept cache run in separate batches, so a sampled run draws
    its random numbers in another row order (same distribution, other draws).
    """
    held: dict[int, list[int]] = {}  # bytes each cache held after every put
    mixed = []  # batches holding rows with and without a kept cache
    real_put, real_batch = PrefixKVCache.put, HFBackend._generate_batch

    def put(self, entry):
        real_put(self, entry)
        held.setdefault(id(self), []).append(self.nbytes)

    def generate_batch(self, prompts, params, kept, keeping):
        mixed.append(len({k is None for k in kept}) > 1)
        return real_batch(self, prompts, params, kept, keeping)

    monkeypatch.setattr(PrefixKVCache, "put", put)
    monkeypatch.setattr(HFBackend, "_generate_batch", generate_batch)
    full_trajs, full = play(tiny, True, do_sample=False)
    plain_trajs, plain = play(tiny, False, do_sample=False)
    budget = max(held[id(full.prefix_cache)]) // 2
    bounded_trajs, bounded = play(tiny, True, do_sample=False, max_bytes=budget)
    assert [t.input_ids for t in bounded_trajs] == [t.input_ids for t in full_trajs] == [t.input_ids for t in plain_trajs]
    assert full.prefix_cache.refused == 0 and bounded.prefix_cache.refused > 0
    assert 0 < max(held[id(bounded.prefix_cache)]) <= budget
    assert 0 < bounded.stats.reused_tokens < full.stats.reused_tokens
    assert full.stats.prefilled_tokens < bounded.stats.prefilled_tokens < plain.stats.prefilled_tokens
    assert mixed and not any(mixed)  # resuming and fresh rows never share a batch


def test_caches_a_call_took_count_against_the_budget_until_their_batch_copied_them(tiny, monkeypatch):
    """A call takes every row's cache first and prefills batch by batch: the later batches' old caches are still in
    memory while the earlier ones store their new, longer caches. Kept and held bytes together stay within the
    budget, and nothing is held once a call has returned."""
    in_memory, after_call = [], []
    real_put, real_generate = PrefixKVCache.put, HFBackend.generate

    def put(self, entry):
        real_put(self, entry)
        in_memory.append(self.nbytes + self.held)

    def generate(self, prompts, params):
        out = real_generate(self, prompts, params)
        after_call.append(self.prefix_cache.held)
        return out

    monkeypatch.setattr(PrefixKVCache, "put", put)
    monkeypatch.setattr(HFBackend, "generate", generate)
    full_trajs, full = play(tiny, True, do_sample=False, batch_size=2)
    budget = max(in_memory) * 2 // 3
    in_memory.clear()
    bounded_trajs, bounded = play(tiny, True, do_sample=False, batch_size=2, max_bytes=budget)
    assert bounded.prefix_cache.refused > 0 and 0 < max(in_memory) <= budget
    assert bounded.prefix_cache.peak_nbytes <= budget
    assert after_call and set(after_call) == {0}
    assert [t.input_ids for t in bounded_trajs] == [t.input_ids for t in full_trajs]


def test_window_prompts_keep_no_cache(tiny, monkeypatch):
    settings = AgentConfig(max_turn=3, context_mode="window", max_context_window=1)
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="fp32")
    puts = []
    monkeypatch.setattr(backend.prefix_cache, "put", lambda e: puts.append(e))
    monkeypatch.setattr(backend.prefix_cache, "take", lambda p: pytest.fail("window prompts do not extend each other"))
    Rollout(backend, tokenizer, settings, SamplingParams(max_new_tokens=8, do_sample=False)).run(
        [make("sokoban")], [1], [0], "sokoban"
    )
    assert puts == [] and backend.stats.reused_tokens == 0


@pytest.mark.parametrize("room", [None, 7])
def test_resumed_prefill_gives_the_full_prefill_logits(tiny, monkeypatch, room):
    """Rows resuming caches of different lengths (one with none) next to padding: same next-token logits as one full
    pass. With ``room`` the cache is assembled straight into growing buffers, here poisoned with NaN first (as
    uninitialised memory may be): every padding column must be written."""
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="fp32")
    allocated = []
    real_allocate = GrowingLayer.allocate.__func__

    def poisoned(cls, *args):
        layer = real_allocate(cls, *args)
        layer._key_buffer.fill_(float("nan"))
        layer._value_buffer.fill_(float("nan"))
        allocated.append(layer)
        return layer

    monkeypatch.setattr(GrowingLayer, "allocate", classmethod(poisoned))
    torch.manual_seed(3)
    prompts = [torch.randint(10, 1000, (n,)).tolist() for n in (37, 52, 45)]
    kept = []
    with torch.no_grad():
        for prompt, c in zip(prompts, (30, 20, 0)):
            if not c:
                kept.append(None)
                continue
            layers = output_cache(model(input_ids=torch.tensor([prompt[:c]]), use_cache=True)).layers
            kept.append(CachedPrefix(tuple(prompt[:c]), [l.keys[0] for l in layers], [l.values[0] for l in layers]))
        resumed = backend._resume_prefill(prompts, kept, room)
        ids, mask, cache = resumed.input_ids, resumed.attention_mask, resumed.cache
        assert cache.get_seq_length() == ids.shape[1] - 1
        if room is not None:  # built in place: the same buffers, room for the last column and the new tokens
            assert [id(layer) for layer in cache.layers] == [id(layer) for layer in allocated]
            assert all(layer._key_buffer.shape[2] == ids.shape[1] + room for layer in allocated)
        else:
            assert not allocated
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        resumed = model(
            input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions[:, -1:], **with_cache(cache)
        ).logits[:, -1]  # (B, V)
        full = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])  # (B, V)
    assert [ids[r][mask[r].bool()].tolist() for r in range(3)] == prompts
    torch.testing.assert_close(resumed, full, atol=1e-5, rtol=1e-4)
    assert backend.stats.reused_tokens == 50 and backend.stats.prefilled_tokens == (36 - 30) + (51 - 20) + 44 + 3


def assert_entries_match_a_fresh_forward(model, kept: PrefixKVCache) -> int:
    """Every stored entry's keys/values equal those of one plain forward over its token ids; returns the count."""
    n = 0
    for same in kept._entries.values():
        for e in same:
            with torch.no_grad():
                fresh = output_cache(model(input_ids=torch.tensor([list(e.token_ids)]), use_cache=True)).layers
            for layer, k, v in zip(fresh, e.keys, e.values):
                torch.testing.assert_close(k, layer.keys[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(v, layer.values[0], atol=1e-5, rtol=1e-4)
            n += 1
    return n


@pytest.mark.parametrize("finish", ["eos", "stop"])
def test_kept_keys_and_values_are_what_a_fresh_forward_computes(tiny, finish):
    """Rows ending at different steps (EOS or stop string, and length), kept over two turns through the two-block layout.

    Comparing sampled tokens alone cannot catch wrong kept caches on a random model (its samples
    hardly depend on context), so the stored tensors themselves are checked.
    """
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="fp32")
    ender = {982, 27394}  # tokens this tiny model emits early for some of these prompts (checked below)
    if finish == "eos":
        backend.eos_ids = backend.eos_ids | ender
        params = SamplingParams(max_new_tokens=12, do_sample=False)
    else:
        params = SamplingParams(max_new_tokens=12, do_sample=False, stop=tuple(tokenizer.decode([t]) for t in ender))
    torch.manual_seed(0)
    prompts = [torch.randint(10, 1000, (n,)).tolist() for n in (12, 20, 7, 15)]
    plain = HFBackend(model, tokenizer, precision="fp32", reuse_kv=False)
    plain.eos_ids = backend.eos_ids
    with backend.prefix_cache.session():
        first = backend.generate(prompts, params)
        reasons = {g.finish_reason for g in first}
        assert finish in reasons and "length" in reasons, [(g.finish_reason, len(g.token_ids)) for g in first]
        assert len({len(g.token_ids) for g in first}) > 1  # rows finished at different steps
        assert assert_entries_match_a_fresh_forward(model, backend.prefix_cache) == 4
        # turn 2: rows 0-2 extend their episode by different amounts; row 3 is a new prompt with no entry
        second_prompts = [prompts[i] + first[i].token_ids + [5, 6, 7, 8, 9][: i + 2] for i in range(3)] + [[11, 12, 13]]
        second = backend.generate(second_prompts, params)
        assert backend.stats.reused_tokens > 0
        assert assert_entries_match_a_fresh_forward(model, backend.prefix_cache) == 4  # turn-1 entries were used up
    assert [g.token_ids for g in second] == [g.token_ids for g in plain.generate(second_prompts, params)]


def test_entries_no_prompt_took_are_dropped_at_the_next_call(tiny):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="fp32")
    params = SamplingParams(max_new_tokens=4, do_sample=False)
    with backend.prefix_cache.session():
        first = backend.generate([[20, 21, 22], [30, 31, 32, 33]], params)
        assert len(backend.prefix_cache) == 2
        backend.generate([[20, 21, 22] + first[0].token_ids + [7]], params)  # the second episode has ended
        assert len(backend.prefix_cache) == 1  # only the continuing episode's new entry


def second_turn_prompts(tiny, max_bytes, batch_size=2):
    """Turn 1 plays rows A and B; turn 2 plays a fresh row C, then A and B continued. Returns the
    backend, the turn-2 prompts, their outputs and the prompts of each turn-2 batch, in call order."""
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="fp32", batch_size=batch_size, reuse_kv_max_bytes=max_bytes)
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    torch.manual_seed(0)
    a, b, c = [torch.randint(10, 1000, (n,)).tolist() for n in (20, 25, 30)]
    batches = []
    real = backend._generate_batch
    with backend.prefix_cache.session():
        first = backend.generate([a, b], params)
        second_prompts = [c, a + first[0].token_ids + [5, 6], b + first[1].token_ids + [7]]
        backend._generate_batch = lambda prompts, *rest: batches.append(prompts) or real(prompts, *rest)
        second = backend.generate(second_prompts, params)
    return backend, second_prompts, second, batches


def test_rows_keep_their_order_and_batches_until_the_budget_refuses_a_cache(tiny):
    backend, prompts, out, batches = second_turn_prompts(tiny, max_bytes=None)
    assert backend.prefix_cache.refused == 0 and backend.stats.reused_tokens > 0
    assert batches == [prompts[:2], prompts[2:]]  # the batches reuse_kv=false would make


def test_after_a_refusal_resuming_rows_run_apart_and_outputs_come_back_in_row_order(tiny):
    model, tokenizer = tiny
    cfg = model.config
    token_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    # room for row A's turn-1 cache (20 prompt tokens + 5 fed-back replies) but not for B's as well
    backend, prompts, out, batches = second_turn_prompts(tiny, max_bytes=30 * token_bytes)
    assert backend.prefix_cache.refused >= 1  # B at turn 1 (and turn 2's longer caches after it)
    assert batches == [[prompts[1]], [prompts[0], prompts[2]]]  # A resumes alone; C and B prefill together
    plain = HFBackend(model, tokenizer, precision="fp32", reuse_kv=False).generate(
        prompts, SamplingParams(max_new_tokens=6, do_sample=False))
    assert len({tuple(g.token_ids) for g in plain}) == 3  # distinct outputs: a wrong order would show
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]


def test_an_infinite_budget_means_no_bound(tiny, tmp_path):
    from ragen.config import load_config

    model, tokenizer = tiny
    config = load_config("sokoban", ["model=tiny", "rollout.reuse_kv_max_gb=inf"])
    assert HFBackend.from_config(model, tokenizer, config).prefix_cache.max_bytes is None
    config = load_config("sokoban", ["model=tiny", "rollout.reuse_kv_max_gb=0.5"])
    assert HFBackend.from_config(model, tokenizer, config).prefix_cache.max_bytes == 2**29


def test_waves_play_the_same_episodes_with_fewer_caches_in_flight(tiny):
    """``max_in_flight``: episodes in waves, each with its own kept caches: same tokens, nothing re-encoded."""
    model, tokenizer = tiny
    sizes = []

    def run(max_in_flight):
        backend = HFBackend(model, tokenizer, precision="fp32")
        real = backend.generate
        backend.generate = lambda prompts, params: sizes.append(len(prompts)) or real(prompts, params)
        sampling = SamplingParams(max_new_tokens=20, do_sample=False, stop=("</answer>",))
        rollout = Rollout(backend, tokenizer, AgentConfig(max_turn=4, max_actions_per_turn=2), sampling,
                          max_in_flight=max_in_flight)
        seeds = [1, 1, 1, 2, 2, 3]
        return rollout.run([make("sokoban") for _ in seeds], seeds, [0, 0, 0, 1, 1, 2], "sokoban"), backend

    all_trajs, all_at_once = run(0)
    assert max(sizes) == 6
    sizes.clear()
    wave_trajs, waves = run(4)
    assert max(sizes) == 4 and 2 in sizes  # a wave of 4 episodes, then one of 2
    assert [t.input_ids for t in wave_trajs] == [t.input_ids for t in all_trajs]
    assert waves.stats.reused_tokens == all_at_once.stats.reused_tokens > 0  # every wave kept its caches
    assert waves.prefix_cache.peak_nbytes < all_at_once.prefix_cache.peak_nbytes
    with pytest.raises(ValueError, match="max_in_flight"):
        Rollout(waves, tokenizer, AgentConfig(), SamplingParams(), max_in_flight=-1)


def test_single_turn_episodes_play_at_once_whatever_the_wave_size(tiny):
    """Waves bound the caches kept between turns; episodes of one turn keep none, so they are never cut."""
    model, tokenizer = tiny
    sizes = []
    backend = HFBackend(model, tokenizer, precision="fp32")
    real = backend.generate
    backend.generate = lambda prompts, params: sizes.append(len(prompts)) or real(prompts, params)
    sampling = SamplingParams(max_new_tokens=8, do_sample=False, stop=("</answer>",))
    seeds = [1, 1, 2, 2, 3, 3]
    for max_turn, expected in [(1, [6]), (2, [2, 2, 2])]:
        sizes.clear()
        rollout = Rollout(backend, tokenizer, AgentConfig(max_turn=max_turn), sampling, max_in_flight=2)
        rollout.run([make("sokoban") for _ in seeds], seeds, [0, 0, 1, 1, 2, 2], "sokoban")
        assert sizes[: len(expected)] == expected
