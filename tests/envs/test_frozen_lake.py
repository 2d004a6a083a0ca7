"""FrozenLake env: same dynamics as gymnasium's FrozenLake-v1, text layer, maps, solver."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import MAPS
from gymnasium.utils.env_checker import check_env

from ragen.envs.frozen_lake import FrozenLakeEnv, parse_map, solve, success_probability
from ragen.envs.registry import make

LEFT, DOWN, RIGHT, UP = 1, 2, 3, 4
STANDARD = MAPS["4x4"]  # SFFF / FHFH / FFFH / HFFG


def play(desc, **cfg) -> FrozenLakeEnv:
    env = FrozenLakeEnv(**cfg)
    env.reset(seed=0, options={"map": desc})
    return env


def test_check_env_and_registry():
    env = make("frozen_lake")
    assert isinstance(env, FrozenLakeEnv)
    check_env(FrozenLakeEnv(size=5, is_slippery=False))
    check_env(FrozenLakeEnv(size=5, is_slippery=False, render_mode="rgb_array"))
    assert env.description and "Left" in env.instructions


def test_render_symbols():
    env = play(["SFH", "FFF", "FFG"], is_slippery=False)
    assert env.render() == "P_O\n___\n__G"
    obs, reward, terminated, truncated, info = env.step(RIGHT)
    assert obs == "_PO\n___\n__G" and reward == 0 and not terminated and info["action_is_effective"]
    obs, reward, terminated, _, info = env.step(RIGHT)
    assert obs == "__X\n___\n__G" and reward == 0 and terminated and not info["success"]


def test_reach_goal_deterministic():
    env = play(["SF", "FG"], is_slippery=False)
    env.step(DOWN)
    obs, reward, terminated, truncated, info = env.step(RIGHT)
    assert obs == "__\n_√" and reward == 1.0 and terminated and not truncated and info["success"]
    with pytest.raises(ValueError, match="episode is over"):
        env.step(LEFT)


def test_bump_into_border_is_ineffective():
    env = play(["SF", "FG"], is_slippery=False)
    _, _, _, _, info = env.step(UP)
    assert not info["action_is_effective"] and info["action_is_valid"]


def test_truncation_at_max_steps():
    env = play(["SF", "FG"], is_slippery=False, max_steps=3)
    results = [env.step(LEFT) for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True]
    assert not any(r[2] for r in results)
    with pytest.raises(ValueError, match="episode is over"):
        env.step(LEFT)


@pytest.mark.parametrize("slippery", [True, False])
def test_transitions_equal_gymnasium(slippery):
    for seed in range(40):
        env = FrozenLakeEnv(size=4, is_slippery=slippery)
        env.reset(seed=seed)
        ref = gym.make("FrozenLake-v1", desc=env.desc, is_slippery=slippery)
        state, _ = ref.reset(seed=seed)
        assert state == env.state
        actions = np.random.default_rng(seed).integers(1, 5, size=30)
        for action in actions:
            obs, reward, terminated, truncated, info = env.step(int(action))
            ref_state, ref_reward, ref_terminated, ref_truncated, ref_info = ref.step(int(action) - 1)
            assert (env.state, reward, terminated) == (ref_state, ref_reward, ref_terminated)
            assert info["prob"] == pytest.approx(ref_info["prob"])
            if terminated or truncated:
                break


def test_same_seed_same_episode():
    def episode(seed):
        env = FrozenLakeEnv(size=6)
        obs, _ = env.reset(seed=seed)
        out = [obs]
        for action in [DOWN, RIGHT] * 10:
            obs, reward, terminated, truncated, _ = env.step(action)
            out.append((obs, reward))
            if terminated or truncated:
                break
        return out

    assert episode(7) == episode(7)
    maps = {tuple(FrozenLakeEnv(size=6).reset(seed=s)[0].splitlines()) for s in range(10)}
    assert len(maps) > 1


def test_generated_maps_are_solvable():
    for seed in range(20):
        env = FrozenLakeEnv(size=5, p=0.6, is_slippery=False)
        env.reset(seed=seed)
        assert success_probability(env) == pytest.approx(1.0)


def test_value_iteration_standard_map_deterministic():
    env = play(STANDARD, is_slippery=False)
    assert success_probability(env) == pytest.approx(1.0)
    assert success_probability(env, horizon=6) == pytest.approx(1.0)  # shortest path is 6 moves
    assert success_probability(env, horizon=5) == 0.0
    policy = solve(env)
    for _ in range(6):
        _, reward, terminated, _, _ = env.step(policy[env.state])
    assert terminated and reward == 1.0


def test_value_iteration_standard_map_slippery_monte_carlo():
    env = play(STANDARD)
    assert success_probability(env) == pytest.approx(0.8235, abs=1e-3)  # infinite horizon
    exact = success_probability(env, horizon=100)
    assert exact == pytest.approx(0.74, abs=0.01)
    policy = solve(env)
    wins, n = 0, 1000
    for seed in range(n):
        env.reset(seed=seed, options={"map": STANDARD})
        terminated = truncated = False
        while not (terminated or truncated):
            _, reward, terminated, truncated, _ = env.step(policy[env.state])
        wins += reward == 1.0
    assert wins / n == pytest.approx(exact, abs=0.05)


def test_solve_accepts_gymnasium_env():
    ref = gym.make("FrozenLake-v1", desc=STANDARD, is_slippery=False)
    assert solve(ref) == solve(play(STANDARD, is_slippery=False))


@pytest.mark.parametrize(
    "desc, match",
    [
        (["SF", "F"], "ragged"),
        (["SX", "FG"], "unknown characters"),
        (["SS", "FG"], "exactly one 'S'"),
        (["SF", "FF"], "exactly one 'G'"),
        ([], "non-empty"),
        (42, "list of row strings"),
    ],
)
def test_bad_maps(desc, match):
    with pytest.raises(ValueError, match=match):
        FrozenLakeEnv().reset(options={"map": desc})


def test_map_as_string_and_rectangular():
    assert parse_map("SFF\nFHG\n") == ["SFF", "FHG"]
    env = play(["SFFFF", "FFFHG"], is_slippery=False)
    assert env.render() in env.observation_space


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"size": 1}, "size"),
        ({"p": 0.0}, "p "),
        ({"p": 1.5}, "p "),
        ({"success_rate": 0}, "success_rate"),
        ({"max_steps": 0}, "max_steps"),
        ({"slippery": True}, "unknown config key"),
    ],
)
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        FrozenLakeEnv(**cfg)


def test_bad_action():
    env = play(STANDARD)
    with pytest.raises(ValueError, match="invalid action id"):
        env.step(0)
    assert env.parse_action(" down ") == DOWN and env.parse_action("jump") is None
