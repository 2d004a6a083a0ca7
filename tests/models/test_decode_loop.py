"""ragen's decode loop samples exactly what ``generate`` samples: tokens, finish reasons, kept caches."""

import pytest
import torch

from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models import decode_loop


def prompts(tokenizer):
    texts = ["The arms are Apple and Stuntman.", "Push the box onto the target, now.", "Hi"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    return [ids[0]] * 2 + [ids[1]] * 2 + [ids[2]] * 2


def both(tiny, params, monkeypatch, eos=None, expect_loop=True, **backend_kwargs):
    """Generations with the decode loop on and off, from the same seed; asserts whether the loop really ran."""
    model, tokenizer = tiny
    calls = []
    real = decode_loop.decode
    monkeypatch.setattr("ragen.models.backend.decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = {}
    for on in (True, False):
        backend = HFBackend(model, tokenizer, precision="fp32", decode_loop=on, **backend_kwargs)
        if eos is not None:
            backend.eos_ids = set(eos)
        torch.manual_seed(0)
        out[on] = backend.generate(prompts(tokenizer), params)
        assert bool(calls) == (on and expect_loop)
        calls.clear()
    return out[True], out[False]


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("warp", [dict(), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_the_loop_samples_generates_tokens(tiny, monkeypatch, do_sample, warp):
    params = SamplingParams(max_new_tokens=10, do_sample=do_sample, **warp)
    loop, plain = both(tiny, params, monkeypatch)
    assert [g.token_ids for g in loop] == [g.token_ids for g in plain]
    assert all(len(g.token_ids) == 10 and g.finish_reason == "length" for g in loop)


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("finish", ["eos", "stop", "both"])
def test_rows_finish_on_eos_and_stop_strings_as_in_generate(tiny, monkeypatch, do_sample, finish):
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=12, do_sample=do_sample, temperature=1.0)
    first, _ = both(tiny, params, monkeypatch)
    # an "EOS" the model samples mid-way in some rows, and a stop string from another row's text
    eos = {first[0].token_ids[3], first[2].token_ids[5]} if finish != "stop" else None
    stop = (tokenizer.decode(first[4].token_ids[4:6]),) if finish != "eos" else ()
    params = SamplingParams(max_new_tokens=12, do_sample=do_sample, temperature=1.0, stop=stop,
                            min_new_tokens=2 if finish == "both" else 0)
    loop, plain = both(tiny, params, monkeypatch, eos=eos)
    assert [g.token_ids for g in loop] == [g.token_ids for g in plain]
    assert [g.finish_reason for g in loop] == [g.finish_reason for g in plain]
    if finish != "both":  # (with min_new_tokens the paths change: which reasons occur is not fixed)
        assert finish in {g.finish_reason for g in loop}


def test_every_row_finished_ends_the_loop_early(tiny, monkeypatch):
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    first, _ = both(tiny, params, monkeypatch)
    eos = {g.token_ids[1] for g in first}  # every row samples an "EOS" by its second token
    steps = []
    real = decode_loop.decode
    monkeypatch.setattr("ragen.models.backend.decode",
                        lambda *a, **k: (lambda out: steps.append(out.sequences.shape[1]) or out)(real(*a, **k)))
    backend = HFBackend(model, tokenizer, precision="fp32")
    backend.eos_ids = eos
    gens = backend.generate(prompts(tokenizer), params)
    assert all(g.finish_reason == "eos" and len(g.token_ids) <= 2 for g in gens)
    assert len(steps) == 1 and steps[0] <= max(map(len, prompts(tokenizer))) + 2  # at most two steps, not twelve


def test_kept_caches_through_the_loop_play_the_same_multi_turn_tokens(tiny):
    from tests.models.rollouts import play

    runs = {}
    for on in (True, False):
        import ragen.models.backend as backend_module

        original = backend_module.HFBackend.__init__

        def init(self, *a, **k):
            original(self, *a, **k)
            self.decode_loop = on

        backend_module.HFBackend.__init__ = init
        try:
            runs[on] = play(tiny, True, do_sample=True)
        finally:
            backend_module.HFBackend.__init__ = original
    (loop_trajs, loop), (plain_trajs, plain) = runs[True], runs[False]
    assert [t.input_ids for t in loop_trajs] == [t.input_ids for t in plain_trajs]
    assert loop.stats.reused_tokens == plain.stats.reused_tokens > 0


def test_every_row_stopped_by_a_stop_string_ends_the_loop_early(tiny, monkeypatch):
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    first, _ = both(tiny, params, monkeypatch)
    stops = tuple({tokenizer.decode(g.token_ids[:2]) for g in first})  # each row's text after two tokens
    steps = []
    real = decode_loop.decode
    monkeypatch.setattr("ragen.models.backend.decode",
                        lambda *a, **k: (lambda out: steps.append(out.sequences.shape[1]) or out)(real(*a, **k)))
    backend = HFBackend(model, tokenizer, precision="fp32")
    gens = backend.generate(prompts(tokenizer), SamplingParams(max_new_tokens=12, do_sample=False, stop=stops))
    reasons = {g.finish_reason for g in gens}  # (the tiny model samples EOS second in some rows)
    assert "stop" in reasons and reasons <= {"stop", "eos"} and all(len(g.token_ids) <= 2 for g in gens)
    assert len(steps) == 1 and steps[0] <= max(map(len, prompts(tokenizer))) + 2  # stopped, not run to twelve


@pytest.mark.parametrize("decode_loop_on", [True, False])
def test_stop_string_criteria_are_built_once_per_tokenizer_and_stop_strings(monkeypatch, decode_loop_on):
    """Building transformers' StopStringCriteria reads and sorts the whole vocabulary (~0.12 s for 49,152 tokens):
    once per tokenizer and stop strings, not on every call; a tokenizer that gains a token gets a new one."""
    model, tokenizer = load_model("tiny")  # its own tokenizer: add_tokens below changes it
    built = []
    real = decode_loop.StopStringCriteria
    monkeypatch.setattr(decode_loop, "StopStringCriteria", lambda *a: built.append(a[1]) or real(*a))
    backend = HFBackend(model, tokenizer, precision="fp32", decode_loop=decode_loop_on)
    ids = prompts(tokenizer)
    first = backend.generate(ids, SamplingParams(max_new_tokens=6, do_sample=False, stop=("the", "a")))
    again = backend.generate(ids, SamplingParams(max_new_tokens=6, do_sample=False, stop=("the", "a")))
    assert [g.token_ids for g in again] == [g.token_ids for g in first]
    assert built == [["the", "a"]]
    backend.generate(ids, SamplingParams(max_new_tokens=6, do_sample=False, stop=("b",)))
    assert built == [["the", "a"], ["b"]]
    criterion = decode_loop.stop_string_criteria(tokenizer, ("b",))
    tokenizer.add_tokens(["<never-seen>"])
    assert decode_loop.stop_string_criteria(tokenizer, ("b",)) is not criterion and len(built) == 3


@pytest.mark.parametrize("setting", [dict(repetition_penalty=3.0), dict(no_repeat_ngram_size=2),
                                     dict(suppress_tokens=[5, 6, 7])])
def test_generation_config_settings_the_loop_lacks_go_to_generate(monkeypatch, setting):
    """A model whose own generation_config asks for a logits processor keeps generate's tokens (the loop is skipped)."""
    model, tokenizer = load_model("tiny")
    for k, v in setting.items():
        setattr(model.generation_config, k, v)
    assert decode_loop.unsupported_setting(model.generation_config) is not None
    params = SamplingParams(max_new_tokens=8, do_sample=True, temperature=1.0)
    loop, plain = both((model, tokenizer), params, monkeypatch, expect_loop=False)
    assert [g.token_ids for g in loop] == [g.token_ids for g in plain]
    assert decode_loop.unsupported_setting(load_model("tiny")[0].generation_config) is None  # the default: the loop runs
