"""KV caches kept between turns: a turn prefills only its new tokens, and samples exactly what a full prefill would."""

import pytest
import torch

from ragen.agent.rollout import AgentSettings, Rollout
from ragen.envs.registry import make
from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.prefix_cache import CachedPrefix, PrefixKVCache


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


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def play(tiny, reuse_kv, *, do_sample, settings=None, seeds=(1, 1, 1, 2, 2, 3)):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="fp32", reuse_kv=reuse_kv)
    settings = settings or AgentSettings(max_turn=4, max_actions_per_turn=2)
    sampling = SamplingParams(max_new_tokens=20, do_sample=do_sample, temperature=1.0, stop=("</answer>",))
    rollout = Rollout(backend, tokenizer, settings, sampling)
    torch.manual_seed(0)
    trajs = rollout.run([make("sokoban") for _ in seeds], list(seeds), [0, 0, 0, 1, 1, 2][: len(seeds)], "sokoban")
    return trajs, backend


@pytest.mark.parametrize("do_sample", [False, True])
def test_rollout_with_kept_caches_plays_the_same_tokens_and_prefills_far_fewer(tiny, do_sample):
    kept_trajs, kept = play(tiny, True, do_sample=do_sample)
    plain_trajs, plain = play(tiny, False, do_sample=do_sample)
    assert [t.input_ids for t in kept_trajs] == [t.input_ids for t in plain_trajs]
    assert [t.loss_mask for t in kept_trajs] == [t.loss_mask for t in plain_trajs]
    assert all(len(t.turns) == 4 for t in kept_trajs)  # the tiny model never finishes: every turn resumes a cache
    assert plain.stats.reused_tokens == 0
    assert kept.stats.reused_tokens > 0
    # turns 2-4 prefill only the reply's last token and the env's answer, not the history
    assert kept.stats.prefilled_tokens < 0.5 * plain.stats.prefilled_tokens
    assert len(kept.prefix_cache) == 0  # the session ended with the rollout


def test_window_prompts_keep_no_cache(tiny, monkeypatch):
    settings = AgentSettings(max_turn=3, context_mode="window", max_context_window=1)
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="fp32")
    puts = []
    monkeypatch.setattr(backend.prefix_cache, "put", lambda e: puts.append(e))
    monkeypatch.setattr(backend.prefix_cache, "take", lambda p: pytest.fail("window prompts do not extend each other"))
    Rollout(backend, tokenizer, settings, SamplingParams(max_new_tokens=8, do_sample=False)).run(
        [make("sokoban")], [1], [0], "sokoban"
    )
    assert puts == [] and backend.stats.reused_tokens == 0


def test_resumed_prefill_gives_the_full_prefill_logits(tiny):
    """Rows resuming caches of different lengths (one with none) next to padding: same next-token logits as one full pass."""
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="fp32")
    torch.manual_seed(3)
    prompts = [torch.randint(10, 1000, (n,)).tolist() for n in (37, 52, 45)]
    kept = []
    with torch.no_grad():
        for prompt, c in zip(prompts, (30, 20, 0)):
            if not c:
                kept.append(None)
                continue
            layers = model(input_ids=torch.tensor([prompt[:c]]), use_cache=True).past_key_values.layers
            kept.append(CachedPrefix(tuple(prompt[:c]), [l.keys[0] for l in layers], [l.values[0] for l in layers]))
        ids, mask, cache = backend._resume_prefill(prompts, kept)
        assert cache.get_seq_length() == ids.shape[1] - 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        resumed = model(
            input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions[:, -1:], past_key_values=cache
        ).logits[:, -1]  # (B, V)
        full = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])  # (B, V)
    assert [ids[r][mask[r].bool()].tolist() for r in range(3)] == prompts
    torch.testing.assert_close(resumed, full, atol=1e-5, rtol=1e-4)
    assert backend.stats.reused_tokens == 50 and backend.stats.prefilled_tokens == (36 - 30) + (51 - 20) + 44 + 3
