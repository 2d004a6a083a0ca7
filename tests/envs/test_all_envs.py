"""Every registered env passes gymnasium's checker and is deterministic under a seed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import ragen.envs
from ragen.envs import make, registered

#: "textarena" needs an optional package and a game name: tests/envs/test_textarena_adapter.py covers it
NAMES = sorted(set(registered()) - {"textarena"})


def test_builtin_envs_are_registered():
    assert {"bandit", "sokoban", "frozen_lake", "countdown", "sudoku", "math_qa"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_check_env(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(make(name))


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_observation_and_contract(name):
    env = make(name)
    first, _ = env.reset(seed=123)
    second, _ = env.reset(seed=123)
    assert first == second
    assert first in env.observation_space
    assert env.description and env.instructions
    base = env.unwrapped
    assert isinstance(base, ragen.envs.TextEnv)
    action = next(iter(base.action_lookup))
    # parse_action of an action's own name gives back an id valid for step (free-text envs: their fixed id).
    parsed = base.parse_action(base.action_lookup[action])
    if parsed is not None:
        action = parsed
    obs, reward, terminated, truncated, info = env.step(action)
    assert {"success", "action_is_valid", "action_is_effective"} <= set(info)
    assert obs in env.observation_space
    with pytest.raises(ValueError):
        env.step(max(base.action_lookup) + 1)


@pytest.mark.parametrize("name", sorted(registered()))
def test_render_modes_are_checked_and_include_text_and_ansi(name):
    """Every env declares the text modes the docs promise and refuses others (Bandit, Countdown, Sudoku, MathQA and
    TextArena took any ``render_mode``: ``make('bandit', render_mode='rgb_array').render()`` returned a str)."""
    cls = registered()[name]
    assert {"text", "ansi"} <= set(cls.metadata["render_modes"])
    with pytest.raises(ValueError, match=f"{name}: unsupported render_mode 'human'; supported: text, ansi"):
        make(name, render_mode="human")
    if "rgb_array" not in cls.metadata["render_modes"]:
        with pytest.raises(ValueError, match="render_mode 'rgb_array'"):
            make(name, render_mode="rgb_array")
    if name != "textarena":  # needs the optional package: tests/envs/test_textarena_adapter.py
        for mode in ("text", "ansi"):
            env = make(name, render_mode=mode)
            obs, _ = env.reset(seed=5)
            assert env.render_mode == mode and env.render() == obs == make(name).reset(seed=5)[0]


@pytest.mark.parametrize("name", NAMES)
def test_step_refuses_ids_that_are_not_integers(name):
    """``step(True)``, ``step(1.0)``, ``step('1')`` name a valid id only after ``int()``: a ``ValueError``, and the
    env is left as it was; a NumPy integer (``action_space.sample()``) is an id."""
    env = make(name)
    obs, _ = env.reset(seed=7)
    action = min(env.unwrapped.action_lookup)
    for bad in (True, float(action), str(action), None):
        with pytest.raises(ValueError, match="action must be an int id"):
            env.step(bad)
        assert env.render() == obs
    assert env.step(np.int64(action))[0] in env.observation_space
