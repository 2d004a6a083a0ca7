"""ragen.envs.base's shared helpers."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.utils import seeding

import ragen.envs
from ragen.envs.base import after_start_rng


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
