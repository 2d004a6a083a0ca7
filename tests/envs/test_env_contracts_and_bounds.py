"""Env contracts and config bounds: 2048's start board and target, Bandit's payoffs, env tag horizons, reward range,
what a user env's ``step`` and ``parse_action`` return."""

from __future__ import annotations

from fractions import Fraction

import pytest

import ragen.envs
from ragen.envs.game2048 import move


def test_2048_start_board_never_holds_the_target_tile():
    """With ``target=4`` a spawned 4 *is* the target: the start board was already won (reset said
    ``success=False``) and any move, even one that changes nothing, then "won". Refused as a config."""
    with pytest.raises(ValueError, match="target"):
        ragen.envs.make("game2048", target=4)
    env = ragen.envs.make("game2048", target=4, spawn_four_prob=0.0)  # only 2s spawn: a merge is needed to win
    for seed in range(50):
        _, info = env.reset(seed=seed)
        assert info["max_tile"] < 4 and not info["success"]
        wasted = [a for a in env.action_lookup if not move(env.board, a)[2]]
        if wasted:
            assert not env.step(wasted[0])[4]["success"]


def test_2048_target_beyond_64_bit_tiles_is_a_config_error():
    """Tiles are int64: a target above 2**62 let a merge overflow (``OverflowError`` from ``step``)."""
    with pytest.raises(ValueError, match="target"):
        ragen.envs.make("game2048", size=2, target=2**64)
    env = ragen.envs.make("game2048", size=2, target=2**62)  # the largest target that fits still plays
    env.reset(seed=0, options={"board": [[2**61, 2**61], [0, 0]]})
    _, reward, terminated, _, info = env.step(3)  # Left: the two tiles merge into the target
    assert reward == 2**62 and terminated and info["success"]


@pytest.mark.parametrize("key", ["low_payoff", "high_payoff"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_bandit_payoffs_must_be_finite(key, value):
    """A NaN or infinite payoff made every episode's reward non-finite (an env error in the rollout); a NaN
    ``high_payoff`` also made the low arm the "best" one. Now a config error naming the key."""
    with pytest.raises(ValueError, match=key):
        ragen.envs.make("bandit", **{key: value})


@pytest.mark.parametrize("key", ["max_turn", "max_actions_per_turn", "max_actions_per_traj"])
def test_env_tag_horizon_refuses_a_bool(key):
    """``True`` is an ``int`` to Python: ``resolve_tag`` took ``max_turn: true`` as 1 turn."""
    from ragen.envs.tags import TagError, resolve_tag

    with pytest.raises(TagError, match=key):
        resolve_tag("T", {"T": {"env": "bandit", key: True}})


@pytest.mark.parametrize("reward", [10**400, -(10**400), Fraction(10**400, 3)], ids=["int", "negative_int", "fraction"])
def test_a_reward_beyond_float_range_is_a_contract_error(reward):
    """An int (or Fraction) reward too big for a float raised a bare ``OverflowError`` from the check, which
    names neither the env nor the value (and ``ragen sft generate`` only catches ``EnvContractError``)."""
    from ragen.envs.contract import EnvContractError, checked_reward

    class HugeEnv:
        pass

    with pytest.raises(EnvContractError, match="HugeEnv.step returned a non-finite reward"):
        checked_reward(HugeEnv(), reward)


def test_math_qa_scans_a_data_sets_questions_once_not_once_per_env(monkeypatch):
    """Every MathQA env scanned every question for its observation charset: with MetaMathQA's ~400k problems
    that cost seconds per env, and a run makes one env per training slot and per validation/eval episode."""
    from ragen.envs import math_qa

    class Question(str):
        scans = 0

        def __iter__(self):
            Question.scans += 1
            return super().__iter__()

    items = [(Question(f"Review question {i}: what is {i} + 1? é"), f"#### {i + 1}") for i in range(100)]
    monkeypatch.setattr(math_qa, "load_items", lambda config: list(items))
    first, second = ragen.envs.make("math_qa"), ragen.envs.make("math_qa")
    assert Question.scans == len(items)  # the first env's scan only
    for env in (first, second):
        obs, _ = env.reset(options={"index": 3})
        assert obs == items[3][0] and env.observation_space.contains(obs)
        assert env.observation_space.contains(env.step(env.parse_action("4"))[0])


def test_play_checks_what_a_user_envs_step_and_parse_action_return():
    """``ragen play`` checked ``reset`` against the contract but not ``step`` or ``parse_action``: a user env whose
    ``step`` returned ``info=None`` crashed it with an ``AttributeError`` traceback (the CLI turns only
    ``ValueError`` into its one-line error), and a ``str`` id reached ``step``. Now the contract's sentence."""
    from gymnasium import spaces

    from ragen.envs.contract import EnvContractError
    from ragen.agent.play import play

    class NoInfoEnv(ragen.envs.TextEnv):
        action_lookup = {1: "go"}
        action_space = spaces.Discrete(1, start=1)
        observation_space = spaces.Text(max_length=10)
        instructions = "Say go."

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return "start", {}

        def step(self, action):
            return "end", 1.0, True, False, None

    class StrIdEnv(NoInfoEnv):
        def parse_action(self, text):
            return "1"

    ragen.envs.register("user_env_no_info", NoInfoEnv)
    ragen.envs.register("user_env_str_id", StrIdEnv)
    for name, message in [("user_env_no_info", "NoInfoEnv.step returned info of type NoneType"),
                          ("user_env_str_id", "StrIdEnv.parse_action\\('go'\\) returned a str")]:
        with pytest.raises(EnvContractError, match=message):
            play(name, {}, seed=0, input_fn=lambda prompt: "go", print_fn=lambda *a: None)


def test_group_member_takes_numpy_integers_like_action_ids_do():
    import numpy as np

    env = ragen.envs.make("bandit", own_payoff_draw=True)
    runs = []
    for member in (2, np.int64(2)):
        env.reset(seed=3, options={"group_member": member})
        runs.append((env.step(1)[1], env.reset(seed=3, options={"group_member": member})[0]))
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="must be an int >= 0"):
        env.reset(seed=3, options={"group_member": np.float64(2)})
