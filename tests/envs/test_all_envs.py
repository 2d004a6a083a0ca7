"""Every registered env passes gymnasium's checker and is deterministic under a seed."""

from __future__ import annotations

import warnings

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
