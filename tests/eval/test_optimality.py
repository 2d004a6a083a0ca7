"""``ragen.eval.optimality``: the performance-difference estimate of a FrozenLake policy's success.

Deterministic ice makes the identity exact per episode (estimate == success); slippery ice is
checked against the exact success probability of stationary policies.
"""

from __future__ import annotations

import copy
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ragen.envs
from ragen.agent.trajectory import Trajectory, Turn
from ragen.envs.agents import ExpertAgent, run_episode
from ragen.envs.frozen_lake import (ACTION_LOOKUP, LakeSolver, policy_success_probability, success_probability,
                                    turn_success_probability)
from ragen.eval.optimality import executed_actions, lake_episode, lake_optimality

SLIPPERY = {"size": 4, "is_slippery": True}
ICE = {"size": 4, "is_slippery": False}


def play(config: dict, seed: int, choose, *, max_turns: int, per_turn: int = 1, max_actions: int | None = None,
         boards: list | None = None):
    """Play with ``choose(state, turn) -> list of action ids`` (empty: an invalid turn); the executed ids per turn
    and whether the goal was reached. ``boards`` (if given) gets the observation text after each turn."""
    env = ragen.envs.make("frozen_lake", **config).unwrapped
    env.reset(seed=seed)
    turns, steps, done = [], 0, False
    for k in range(max_turns):
        if done:
            break
        executed = []
        for a in choose(env.state, k)[:per_turn]:
            if max_actions is not None and steps >= max_actions:
                break
            _, _, terminated, truncated, _ = env.step(a)
            executed.append(a)
            steps += 1
            if terminated or truncated:
                done = True
                break
        turns.append(executed)
        if boards is not None:
            boards.append(env._text())
        if max_actions is not None and steps >= max_actions:
            break
    return turns, env._cell(env.state) == "G"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), moves=st.lists(st.lists(st.integers(1, 4), max_size=3), max_size=12),
       per_turn=st.integers(1, 3), max_turns=st.integers(1, 12), cap=st.one_of(st.none(), st.integers(1, 20)))
def test_on_deterministic_ice_each_estimate_is_the_episodes_success(seed, moves, per_turn, max_turns, cap):
    turns, success = play(ICE, seed, lambda s, k: moves[k] if k < len(moves) else [], max_turns=max_turns,
                          per_turn=per_turn, max_actions=cap)
    ep = lake_episode(ICE, seed, turns, max_turns=max_turns, actions_per_turn=per_turn, max_actions=cap)
    assert ep.success == success
    assert ep.regret >= -1e-12
    assert ep.value_estimate == pytest.approx(float(success), abs=1e-9)


@pytest.mark.parametrize("max_turns,per_turn,cap", [(20, 1, 7), (20, 1, None), (6, 2, 9), (4, 3, None)])
def test_the_optimum_is_the_budgets_best_success_probability(max_turns, per_turn, cap):
    for seed in range(5):
        env = ragen.envs.make("frozen_lake", **SLIPPERY).unwrapped
        env.reset(seed=seed)
        ep = lake_episode(SLIPPERY, seed, [], max_turns=max_turns, actions_per_turn=per_turn, max_actions=cap)
        moves = min(max_turns * per_turn, cap or 10**6, env.config.max_steps)
        assert ep.closed_loop_optimum == pytest.approx(success_probability(env, moves))
        assert ep.turn_optimum == pytest.approx(turn_success_probability(env, max_turns, per_turn, moves))
        assert ep.value_estimate == pytest.approx(0.0)  # no move played: nothing reached


def test_an_invalid_first_turn_costs_exactly_one_move_of_budget():
    # An invalid answer, then the expert: the only regret is the wasted move, V_20(s0) - V_19(s0).
    agent = ExpertAgent(1)
    for seed in range(10):
        env = ragen.envs.make("frozen_lake", **SLIPPERY)
        result = run_episode(env, agent, seed=seed, max_turns=19, record=True, max_actions_per_turn=1, max_actions=19)
        ids = [[]] + [[env.unwrapped.parse_action(a) for a in t["actions"]] for t in result["transcript"]]
        ep = lake_episode(SLIPPERY, seed, ids, max_turns=20, actions_per_turn=1, max_actions=20)
        solver = LakeSolver(env.unwrapped)
        start = solver.model.start
        assert ep.regret == pytest.approx(solver.values(20)[start] - solver.values(19)[start], abs=1e-12)
        assert ep.success == result["success"]


def test_the_expert_has_no_regret_with_several_moves_per_turn_on_deterministic_ice():
    agent = ExpertAgent(2)
    for seed in range(10):
        env = ragen.envs.make("frozen_lake", **ICE)
        result = run_episode(env, agent, seed=seed, max_turns=4, record=True, max_actions_per_turn=2, max_actions=8)
        ids = [[env.unwrapped.parse_action(a) for a in t["actions"]][:2] for t in result["transcript"]]
        ep = lake_episode(ICE, seed, ids, max_turns=4, actions_per_turn=2, max_actions=8)
        assert ep.regret == pytest.approx(0.0, abs=1e-12) and ep.success == result["success"] and ep.closed_loop_optimum == 1.0


def test_moves_the_limits_forbid_are_an_error():
    with pytest.raises(ValueError, match="turns played"):
        lake_episode(ICE, 0, [[2]] * 3, max_turns=2, actions_per_turn=1, max_actions=None)
    with pytest.raises(ValueError, match="allowed"):
        lake_episode(ICE, 0, [[2, 2]], max_turns=2, actions_per_turn=1, max_actions=None)
    with pytest.raises(ValueError, match="budget"):
        lake_episode(ICE, 0, [[2], [2]], max_turns=2, actions_per_turn=1, max_actions=1)


def test_the_expert_has_no_regret_and_scores_the_optimum():
    agent = ExpertAgent(1)
    for seed in range(20):
        env = ragen.envs.make("frozen_lake", **SLIPPERY)
        result = run_episode(env, agent, seed=seed, max_turns=20, record=True, max_actions_per_turn=1, max_actions=20)
        ids = [[env.unwrapped.parse_action(a) for a in t["actions"]] for t in result["transcript"]]
        ep = lake_episode(SLIPPERY, seed, ids, max_turns=20, actions_per_turn=1, max_actions=20)
        assert ep.success == result["success"]
        assert ep.regret == pytest.approx(0.0, abs=1e-12) and ep.optimal_moves == ep.moves


def markov_policy(kind: str, env, horizon: int):
    """``(policy(state, moves_left) -> action id, its exact success probability within horizon)``."""
    if kind in ("always_down", "random_table"):
        table = {s: 2 for s in range(16)} if kind == "always_down" else \
            {s: int(a) for s, a in enumerate(np.random.default_rng(0).integers(1, 5, size=16))}
        return (lambda s, k: table[s]), policy_success_probability(env, horizon, table)
    # The finite-horizon optimum with a wrong move (turned 90 degrees) in one (state, moves left) of eleven:
    # near-optimal, and not stationary. Its exact value by backward induction over its own moves.
    solver = LakeSolver(env)

    def policy(s: int, k: int) -> int:
        best = solver.action(s, k)
        return best % 4 + 1 if (s + k) % 11 == 0 else best

    model, values = solver.model, solver.values(0)
    for k in range(1, horizon + 1):
        q = model.backup(values)  # (4, n)
        values = np.array([q[policy(s, k) - 1, s] for s in range(len(values))])
        values[model.goal], values[model.terminal & ~model.goal] = 1.0, 0.0
    return policy, float(values[model.start])


@pytest.mark.parametrize("kind", ["always_down", "random_table", "near_optimal"])
def test_on_slippery_ice_the_estimate_is_unbiased(kind):
    # Each policy's exact success probability per map is known; the mean estimate over 400 fixed
    # seeds must sit within 3 standard errors of the mean exact value.
    horizon = 20
    estimates, successes, exact = [], [], []
    for seed in range(400):
        env = ragen.envs.make("frozen_lake", **SLIPPERY).unwrapped
        env.reset(seed=seed)
        policy, value = markov_policy(kind, env, horizon)
        exact.append(value)
        turns, success = play(SLIPPERY, seed, lambda s, k: [policy(s, horizon - k)], max_turns=horizon)
        ep = lake_episode(SLIPPERY, seed, turns, max_turns=horizon, actions_per_turn=1, max_actions=None)
        estimates.append(ep.value_estimate)
        successes.append(float(success))
    diff = [e - x for e, x in zip(estimates, exact)]
    se = statistics.stdev(diff) / len(diff) ** 0.5
    assert abs(statistics.fmean(diff)) < 3 * se
    if kind == "near_optimal":
        # What the estimate is for: near-optimal play is measured far more tightly than by counting.
        assert statistics.fmean(exact) > 0.3, statistics.fmean(exact)
        assert statistics.stdev(estimates) < 0.5 * statistics.stdev(successes)


def test_lake_optimality_reads_rollout_trajectories_and_rejects_a_wrong_replay():
    from ragen.agent import AgentConfig

    settings_ = AgentConfig(max_turn=6, max_actions_per_turn=2, max_actions_per_traj=8)
    trajs = []
    for seed in range(5):
        boards: list[str] = []
        turns, success = play(SLIPPERY, seed, lambda s, k: [3, 2] if k % 3 else [], max_turns=6, per_turn=2,
                              max_actions=8, boards=boards)
        traj = Trajectory("frozen_lake", seed, seed, success=success)
        for ids, board in zip(turns, boards):
            names = [ACTION_LOOKUP[a] for a in ids] if ids else ["Jump"]
            traj.turns.append(Turn(response="", actions=names, format_valid=bool(ids), env_reward=0.0,
                                   format_penalty=0.0, observation=board, actions_executed=len(ids)))
        assert executed_actions(traj, ragen.envs.make("frozen_lake", **SLIPPERY)) == turns
        trajs.append(traj)
    report = lake_optimality(trajs, SLIPPERY, settings_)
    assert report["episodes"] == 5 and 0 <= report["optimal_move_rate"] <= 1
    assert report["regret_mean"] > 0  # a third of the turns wasted
    assert report["success"] == statistics.fmean(float(t.success) for t in trajs)
    for tamper in ("success", "moves", "board"):
        broken = copy.deepcopy(trajs)
        if tamper == "success":
            broken[0].success = not broken[0].success
        elif tamper == "moves":
            broken[1].turns[1].actions_executed -= 1  # a move the env made is missing from the record
        else:
            broken[2].turns[-1].observation = "P___\n____\n____\n___G"
        with pytest.raises(RuntimeError, match="replay"):
            lake_optimality(broken, SLIPPERY, settings_)
