"""Micro-batches cut by rows and padded tokens (ragen/train/micro_batches.py), and gradient_checkpointing=auto."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from ragen.config import ConfigError, load_config
from ragen.train.micro_batches import padded_tokens, plan


def test_plan_golden():
    lengths = [100, 90, 80, 40, 30, 10]
    assert plan(lengths, max_rows=16) == [range(0, 6)]
    assert plan(lengths, max_rows=4) == [range(0, 4), range(4, 6)]
    # 250 tokens: 100 + 90 (2 x 100 = 200), then 80 + 40 + 30 (3 x 80 = 240), then 10
    assert plan(lengths, max_rows=16, max_tokens=250) == [range(0, 2), range(2, 5), range(5, 6)]
    assert plan([300, 20], max_rows=16, max_tokens=250) == [range(0, 1), range(1, 2)]  # too long: alone
    assert plan([], max_rows=4, max_tokens=10) == []
    with pytest.raises(ValueError):
        plan([1], max_rows=0)


@given(st.lists(st.integers(1, 500), max_size=40), st.integers(1, 20), st.integers(0, 2000))
def test_plan_covers_every_row_once_in_order_within_bounds(lengths, max_rows, max_tokens):
    batches = plan(lengths, max_rows, max_tokens)
    assert [i for b in batches for i in b] == list(range(len(lengths)))
    for b in batches:
        assert 1 <= len(b) <= max_rows
        cost = len(b) * max(lengths[i] for i in b)
        assert not max_tokens or cost <= max_tokens or len(b) == 1
    # greedy: joining a batch with the next row would have broken a bound
    for a, b in zip(batches, batches[1:]):
        joined = range(a.start, b.start + 1)
        assert len(joined) > max_rows or (max_tokens and len(joined) * max(lengths[i] for i in joined) > max_tokens)
    assert padded_tokens(lengths, batches) >= sum(lengths)


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("true", "true"), ("false", "false"), ("True", "true"),
                                            ("off", "false")])
def test_checkpointing_setting_is_normalised(value, expected):
    assert load_config("bandit", [f"trainer.gradient_checkpointing={value}"]).trainer.gradient_checkpointing == expected


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="trainer.gradient_checkpointing"):
        load_config("bandit", ["trainer.gradient_checkpointing=sometimes"])
    with pytest.raises(ConfigError, match="algorithm.max_tokens_per_micro_batch"):
        load_config("bandit", ["algorithm.max_tokens_per_micro_batch=-1"])


def test_auto_checkpointing_says_once_which_it_chose_and_why():
    from ragen.models import load_model
    from ragen.models.checkpointing import is_checkpointing
    from ragen.train.checkpoint_choice import CheckpointingChoice

    model, _ = load_model("tiny")
    model.train()
    lines: list[str] = []
    choice = CheckpointingChoice(model, "auto", 100, lines.append)
    assert choice.before_update(80) is False and not is_checkpointing(model)
    assert choice.before_update(150) is True and is_checkpointing(model)
    assert choice.before_update(90) is False and not is_checkpointing(model)
    choice.before_update(200)
    assert lines == ["[ragen] activation checkpointing off: every sample fits max_tokens_per_micro_batch=100 "
                     "(longest 80 tokens)",
                     "[ragen] activation checkpointing on: a sample of 150 tokens is longer than "
                     "max_tokens_per_micro_batch=100"]
    never = CheckpointingChoice(model, "false", 100, lines.append)
    assert never.before_update(10_000) is False and not is_checkpointing(model)
    always = CheckpointingChoice(model, "true", 100, lines.append)
    assert always.before_update(10) is True and is_checkpointing(model)


def test_the_memory_guard_warns_once_near_the_machines_memory():
    from ragen.train.memory_guard import GiB, RL_KEYS, MemoryGuard, available_memory, peak_rss

    lines: list[str] = []
    guard = MemoryGuard(RL_KEYS, lines.append, peak=lambda: 9 * GiB, rss=lambda: 8 * GiB, available=lambda: 2 * GiB)
    assert guard.after_step(1) is True and guard.after_step(2) is False  # 9 of 10 GB: once
    assert lines == ["[ragen] memory: step 1 peaked at 9.0 GB of the 10.0 GB this process can have; later steps with "
                     "longer episodes may be killed by the system. Lower algorithm.max_tokens_per_micro_batch, "
                     "rollout.max_episodes_in_flight, rollout.reuse_kv_max_gb, or set lora.rank "
                     "(docs/performance.md, \"Memory\")."]
    roomy = MemoryGuard(RL_KEYS, lines.append, peak=lambda: 4 * GiB, rss=lambda: 3 * GiB, available=lambda: 20 * GiB)
    assert not any(roomy.after_step(s) for s in (1, 2, 3, 4))
    late = MemoryGuard(RL_KEYS, lines.append, peak=lambda: 9 * GiB, rss=lambda: 8 * GiB, available=lambda: 1 * GiB)
    assert late.after_step(4) is False  # only the first steps are judged
    assert peak_rss() is None or peak_rss() > 0
    assert available_memory() is None or available_memory() > 0
