"""ragen.envs.base's shared helpers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gymnasium.utils import seeding

import ragen.envs
from ragen.envs import registry
from ragen.envs.base import after_start_rng, build_config
from ragen.envs.registry import env_config_fields


def test_own_after_start_streams_are_new_for_every_member_including_the_first():
    """An own stream is neither the env's ``np_random`` (which drew the start state) nor its map child
    (``np_random.spawn``), nor another member's: ``default_rng([seed, 0])`` equals ``default_rng(seed)``, and member 0
    would replay the start's draws."""
    env = ragen.envs.make("bandit")
    for seed in (0, 5, 123, 2**31 + 7):
        env.reset(seed=seed)
        shared = seeding.np_random(seed)[0]
        starts = {tuple(shared.random(4)), tuple(shared.spawn(1)[0].random(4))}
        owns = [tuple(after_start_rng(env, seed, {"group_member": j}, True, "t").random(4)) for j in range(4)]
        assert len(set(owns)) == 4 and not starts & set(owns)
        assert owns[2] == tuple(after_start_rng(env, seed, {"group_member": 2}, True, "t").random(4))  # reproducible
        # the default, or no seed: the env's own generator, whatever the member
        assert after_start_rng(env, seed, {"group_member": 3}, False, "t") is env.np_random
        assert after_start_rng(env, None, {"group_member": 3}, True, "t") is env.np_random
    with pytest.raises(ValueError, match="t: options\\['group_member'\\] must be an int >= 0"):
        after_start_rng(env, 0, {"group_member": 1.0}, False, "t")


def test_bandit_own_payoff_is_independent_of_the_arm_names_for_every_member():
    """The payoff of member j must not be a function of the names its seed drew (member 0 once was: the own stream
    replayed the draws that picked the names, so some risky names always paid and others never did)."""
    env = ragen.envs.make("bandit", own_payoff_draw=True)
    for member in (0, 1):
        hits: dict[str, list[float]] = {}
        for seed in range(1600):
            _, info = env.reset(seed=seed, options={"group_member": member})
            hits.setdefault(info["high_arm"], []).append(env.step(env.high_action)[1])
        assert len(hits) >= 6
        for name, rewards in hits.items():  # ~200 pulls a name: 0.25 +- 0.03
            assert abs(np.mean(rewards) - 0.25) < 0.12, (member, name, np.mean(rewards), len(rewards))


# -- build_config: types of every kind of default, default_factory fields --------------------------------------------

@dataclasses.dataclass
class _FactoryConfig:
    names: list = dataclasses.field(default_factory=lambda: ["a", "b"])
    label: str = "x"
    rate: float = 0.5


@pytest.mark.parametrize(
    "env, cfg, match",
    [
        ("bandit", {"name_set": ["train"]}, "bandit: config key 'name_set' must be a string, got \\['train'\\]"),
        ("math_qa", {"path": 5}, "math_qa: config key 'path' must be a string, got 5"),
        ("textarena", {"game": 5}, "textarena: config key 'game' must be a string, got 5"),
        ("sokoban", {"observation_format": None}, "sokoban: config key 'observation_format' must be a string"),
    ],
)
def test_string_config_keys_refuse_other_types(env, cfg, match):
    """A str knob given a list or a number was passed on and failed later (``unhashable type: 'list'``, a TypeError
    opening the file, a traceback from TextArena) instead of naming the key."""
    with pytest.raises(ValueError, match=match):
        ragen.envs.make(env, **cfg)


def test_default_factory_fields_are_type_checked_and_listed_with_their_default():
    """``f.default`` is ``MISSING`` for a ``default_factory`` field: its type went unchecked and ``ragen envs``
    showed ``<dataclasses._MISSING_TYPE object>`` instead of the default."""
    with pytest.raises(ValueError, match="t: config key 'names' must be a list \\(like \\['a', 'b'\\]\\), got 'ab'"):
        build_config(_FactoryConfig, {"names": "ab"}, "t")
    with pytest.raises(ValueError, match="t: config key 'names' must be a list"):
        build_config(_FactoryConfig, {"names": 3}, "t")
    assert build_config(_FactoryConfig, {"names": ["c"], "label": "y"}, "t") == _FactoryConfig(["c"], "y")

    class FactoryEnv(ragen.envs.TextEnv):
        Config = _FactoryConfig

    ragen.envs.register("_test_factory_env", FactoryEnv)
    try:
        assert env_config_fields("_test_factory_env") == {"names": ["a", "b"], "label": "x", "rate": 0.5}
    finally:
        registry._REGISTRY.pop("_test_factory_env")


# -- check_action: integers only ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [True, False, 1.9, 2.0, "2", None, np.float64(1.0), np.bool_(True), np.array([1])])
def test_check_action_refuses_anything_but_an_integer(bad):
    """``int(action)`` once turned ``step(1.9)``, ``step('2')`` and ``step(True)`` into moves on Sokoban."""
    env = ragen.envs.make("sokoban")
    obs, _ = env.reset(seed=0)
    with pytest.raises(ValueError, match="SokobanEnv: action must be an int id"):
        env.step(bad)
    assert env.render() == obs and env.unwrapped.num_steps == 0


def test_check_action_accepts_python_and_numpy_integers():
    env = ragen.envs.make("sokoban")
    env.reset(seed=0)
    for action in (1, np.int64(2), np.uint8(3), np.int32(4)):
        assert env.unwrapped.check_action(action) == int(action) and type(env.unwrapped.check_action(action)) is int
    with pytest.raises(ValueError, match="invalid action id 5"):
        env.unwrapped.check_action(np.int64(5))
