"""Countdown env: exact checker, rewards, generation, expert solver, bad input."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen.envs.countdown import SUBMIT, CountdownEnv, check_answer, solve
from ragen.envs.registry import make


def answer(env: CountdownEnv, text: str):
    action = env.parse_action(text)
    assert action == SUBMIT
    return env.step(action)


def play(numbers, target) -> CountdownEnv:
    env = CountdownEnv()
    env.reset(options={"numbers": numbers, "target": target})
    return env


def test_check_env_and_registry():
    check_env(CountdownEnv())
    assert isinstance(make("countdown"), CountdownEnv)


@pytest.mark.parametrize(
    "text, status",
    [
        ("(25 - 5) * 3", "correct"),
        ("3 * (25 - 5)", "correct"),
        ("(25 - 5) * 3 = 60", "correct"),
        ("60 = 3*(25-5)", "correct"),
        ("25 × 3 - 5 × 3", "malformed"),  # 3 used twice
        ("(25 − 5) × 3", "malformed"),  # unicode minus is not an operator
        ("(25 - 5) × 3", "correct"),
        ("25 + 5 + 3", "wrong"),
        ("25 / (5 - 5)", "malformed"),  # 5 used twice
        ("25 + 5", "wrong"),  # a subset is fine
        ("25 - -5", "malformed"),  # unary minus
        ("25 ** 3", "malformed"),
        ("25.0 + 5", "malformed"),
        ("7 * 5", "malformed"),  # 7 not given
        ("__import__('os')", "malformed"),
        ("", "malformed"),
        ("sixty", "malformed"),
        ("(((25", "malformed"),
    ],
)
def test_checker_rules(text, status):
    assert check_answer(text, [25, 5, 3], 60) == status


def test_division_is_exact_and_division_by_zero_is_wrong():
    assert check_answer("(1 + 1 / 3) * 3", [1, 1, 3, 3], 4) == "correct"
    assert check_answer("8 / 3", [8, 3], 2) == "wrong"
    assert check_answer("5 / (3 - 3)", [5, 3, 3], 1) == "wrong"


def test_rewards_and_single_turn():
    env = play([25, 5, 3], 60)
    obs, reward, terminated, truncated, info = answer(env, "(25-5)*3")
    assert reward == 1.0 and terminated and not truncated and info["success"] and "Correct" in obs
    with pytest.raises(ValueError, match="episode is over"):
        env.step(SUBMIT)
    env = play([25, 5, 3], 60)
    _, reward, _, _, info = answer(env, "25+5")
    assert reward == 0.1 and not info["success"] and info["action_is_valid"]
    env = play([25, 5, 3], 60)
    _, reward, _, _, info = answer(env, "I think 60")
    assert reward == 0.0 and not info["action_is_valid"]


def test_step_without_parsed_answer_and_last_answer_wins():
    env = play([25, 5, 3], 60)
    _, reward, *_ = env.step(SUBMIT)
    assert reward == 0.0
    env = play([25, 5, 3], 60)
    env.parse_action("1 + 2")
    env.parse_action("(25-5)*3")
    assert env.step(SUBMIT)[1] == 1.0
    assert env.parse_action("   ") is None


def test_same_seed_same_instance():
    a, b = CountdownEnv(), CountdownEnv()
    assert a.reset(seed=5) == b.reset(seed=5)
    instances = {CountdownEnv().reset(seed=s)[0] for s in range(20)}
    assert len(instances) > 10


def test_generated_instances_are_in_range_and_solvable():
    env = CountdownEnv()
    start = time.perf_counter()
    for seed in range(100):
        _, info = env.reset(seed=seed)
        numbers, target = info["numbers"], info["target"]
        assert 3 <= len(numbers) <= 4 and all(1 <= n <= 99 for n in numbers)
        assert 1 <= target <= 100
        expression = solve(numbers, target)
        assert expression is not None and check_answer(expression, numbers, target) == "correct"
        assert answer(env, expression)[1] == 1.0
    assert time.perf_counter() - start < 3


def test_solver_known_cases():
    assert check_answer(solve([1, 2, 3, 4], 24), [1, 2, 3, 4], 24) == "correct"
    assert check_answer(solve([3, 3, 8, 8], 24), [3, 3, 8, 8], 24) == "correct"  # 8 / (3 - 8 / 3)
    assert solve([2, 2, 3], 100) is None
    assert solve([7], 7) == "7"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80), st.lists(st.integers(1, 99), min_size=1, max_size=4), st.integers(-5, 200))
def test_checker_never_raises(text, numbers, target):
    assert check_answer(text, numbers, target) in ("correct", "wrong", "malformed")


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.sampled_from(["25", "5", "3", "(", ")", "+", "-", "*", "/", " "]), lambda s: st.lists(s, max_size=6).map("".join), max_leaves=12))
def test_checker_never_raises_on_expression_like_text(text):
    assert check_answer(text, [25, 5, 3], 60) in ("correct", "wrong", "malformed")


def test_deep_nesting_does_not_raise():
    assert check_answer("(" * 5000 + "1" + ")" * 5000, [1], 1) == "malformed"  # too long
    assert check_answer("(" * 99 + "1" + ")" * 99, [1], 1) == "correct"


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"min_numbers": 1}, "min_numbers"),
        ({"min_numbers": 5, "max_numbers": 4}, "min_numbers"),
        ({"max_numbers": 7}, "max_numbers"),
        ({"max_number": 0}, "max_number"),
        ({"max_target": 0}, "max_target"),
        ({"numbers": 3}, "unknown config key"),
    ],
)
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        CountdownEnv(**cfg)


def test_bad_options_and_action():
    env = CountdownEnv()
    with pytest.raises(ValueError, match="numbers"):
        env.reset(options={"numbers": [1, -2], "target": 3})
    with pytest.raises(ValueError, match="target"):
        env.reset(options={"numbers": [1, 2], "target": "3"})
    env.reset(seed=0)
    with pytest.raises(ValueError, match="invalid action id"):
        env.step(2)


def test_generation_gives_up_with_a_clear_error_instead_of_hanging():
    """Numbers up to 10**6 almost never combine to a target of 1: ``generate`` looped forever. It now stops after
    ``max_generation_tries`` draws with an error naming the knobs (run in a subprocess so a hang fails the test)."""
    code = (
        "import ragen.envs\n"
        "try:\n"
        "    ragen.envs.make('countdown', min_numbers=2, max_numbers=2, max_number=10**6, max_target=1).reset(seed=0)\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("countdown generation did not give up within 60 s")
    assert proc.returncode == 0, proc.stderr
    assert "countdown: could not build a target in 1..max_target=1" in proc.stdout
    assert "max_number=1000000" in proc.stdout and "max_generation_tries" in proc.stdout


def test_generation_tries_are_configurable_and_do_not_change_instances():
    with pytest.raises(ValueError, match="max_generation_tries must be >= 1"):
        CountdownEnv(max_generation_tries=0)
    with pytest.raises(ValueError, match="in 3 tries"):
        CountdownEnv(max_number=10**6, max_target=1, min_numbers=2, max_numbers=2, max_generation_tries=3).reset(seed=0)
    for seed in range(20):  # the cap only bounds the loop: a seed's instance is the one it always was
        assert CountdownEnv().reset(seed=seed)[0] == CountdownEnv(max_generation_tries=10**6).reset(seed=seed)[0]
