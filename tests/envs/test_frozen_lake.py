"""FrozenLake env: same dynamics as gymnasium's FrozenLake-v1, text layer, maps, solver."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import MAPS
from gymnasium.utils.env_checker import check_env

from hypothesis import given, settings
from hypothesis import strategies as st

from ragen.envs.frozen_lake import (
    FrozenLakeEnv,
    LakeModel,
    LakeSolver,
    parse_map,
    policy_success_probability,
    solve,
    solve_finite,
    success_probability,
    turn_success_probability,
)
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


def _walk(env, observation, actions):
    """``[observation, (obs, reward) of each step]``, stepping ``actions`` until the episode ends."""
    out = [observation]
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        out.append((obs, reward))
        if terminated or truncated:
            break
    return out


def test_same_seed_same_episode():
    def episode(seed):
        env = FrozenLakeEnv(size=6)
        return _walk(env, env.reset(seed=seed)[0], [DOWN, RIGHT] * 10)

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
    exact = policy_success_probability(env, horizon=100)  # the infinite-horizon policy within 100 moves
    assert exact == pytest.approx(0.74, abs=0.01)
    assert success_probability(env, horizon=100) >= exact  # the 100-move optimum
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
        (["S" + "F" * 32, "F" * 32 + "G"], "at most 32x32, got 2x33"),  # a given map has the bound on `size` too
        (["SF"] + ["FF"] * 31 + ["FG"], "at most 32x32, got 33x2"),
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


# -- finite horizon ------------------------------------------------------------------------------


def _expectimax(lake, state: int, moves: int) -> float:
    """Brute force: the best success probability within ``moves`` moves by searching the whole game
    tree of gymnasium's raw ``P`` (no memo, no arrays: independent of LakeSolver)."""
    cell = lake.desc.ravel()[state]
    if cell == b"G":
        return 1.0
    if cell == b"H" or moves == 0:
        return 0.0
    return max(sum(p * _expectimax(lake, s2, moves - 1) for p, s2, _, _ in lake.P[state][a]) for a in range(4))


def _turn_expectimax(lake, states: dict, turns: int, moves: int, per_turn: int) -> float:
    """Brute force over turn-structured play: each turn commits to a sequence of 1..per_turn moves
    seen from the turn's start state only. ``states``: {state: probability} at the turn start."""
    total = 0.0
    for state, prob in states.items():
        total += prob * _turn_best(lake, state, turns, moves, per_turn)
    return total


def _turn_best(lake, state, turns, moves, per_turn):
    import itertools

    flat = lake.desc.ravel()
    if flat[state] == b"G":
        return 1.0
    if flat[state] == b"H" or turns == 0 or moves == 0:
        return 0.0
    best = 0.0
    for length in range(1, min(per_turn, moves) + 1):
        for seq in itertools.product(range(4), repeat=length):
            dist, won = {state: 1.0}, 0.0
            for a in seq:
                nxt: dict = {}
                for s, p in dist.items():
                    for q, s2, _, _ in lake.P[s][a]:
                        if flat[s2] == b"G":
                            won += p * q
                        elif flat[s2] != b"H":
                            nxt[s2] = nxt.get(s2, 0.0) + p * q
                dist = nxt
            best = max(best, won + _turn_expectimax(lake, dist, turns - 1, moves - length, per_turn))
    return best


SMALL_MAPS = [["SFF", "FHF", "FFG"], ["SFH", "FFF", "HFG"], ["SF", "FG"], ["SFFF", "FHFH", "FFFH", "HFFG"]]


@pytest.mark.parametrize("desc", SMALL_MAPS)
@pytest.mark.parametrize("success_rate", [1 / 3, 0.6, 1.0])
def test_finite_horizon_value_equals_brute_force(desc, success_rate):
    env = play(desc, success_rate=success_rate)
    solver = LakeSolver(env)
    for moves in range(0, 5 if len(desc) < 4 else 4):
        for s in range(len(solver.model.goal)):
            assert solver.values(moves)[s] == pytest.approx(_expectimax(env.lake, s, moves), abs=1e-12), (moves, s)
    assert success_probability(env, horizon=3) == pytest.approx(_expectimax(env.lake, 0, 3), abs=1e-12)


@pytest.mark.parametrize("desc", SMALL_MAPS[:3])
def test_turn_values_equal_brute_force_over_turn_structured_play(desc):
    env = play(desc)
    solver = LakeSolver(env)
    for turns, moves, per_turn in [(1, 2, 2), (2, 4, 2), (2, 3, 2), (3, 4, 2), (1, 3, 3), (2, 5, 3)]:
        brute = _turn_best(env.lake, 0, turns, moves, per_turn)
        assert solver.turn_values(turns, moves, per_turn)[0] == pytest.approx(brute, abs=1e-12), (turns, moves, per_turn)
    # the expert's plan for a turn attains the value
    plan = solver.turn_plan(0, 2, 4, 2)
    assert len(plan) == 2 and all(1 <= a <= 4 for a in plan)


def test_finite_horizon_policy_monte_carlo_on_the_env():
    """The time-dependent policy played on the env's own dynamics wins as often as V_H says."""
    desc = ["SFFF", "FFFF", "HFFF", "FFFG"]
    env = play(desc)
    horizon = 12
    exact = success_probability(env, horizon=horizon)
    policy = solve_finite(env, horizon)
    wins, n = 0, 1500
    for seed in range(n):
        env.reset(seed=seed, options={"map": desc})
        for left in range(horizon, 0, -1):
            _, reward, terminated, _, _ = env.step(policy[left][env.state])
            if terminated:
                break
        wins += reward == 1.0
    assert wins / n == pytest.approx(exact, abs=4 * (exact * (1 - exact) / n) ** 0.5)
    # and it beats the infinite-horizon policy within the same cap, which here (value 1 from every cell) is the
    # fastest way to the goal without any risk: 0.305 vs 0.303 (0.050 when solve() broke value ties by gym order alone)
    assert exact > policy_success_probability(env, horizon) + 1e-3


def test_finite_horizon_is_the_infinite_policy_with_moves_to_spare():
    env = play(STANDARD, is_slippery=False)
    solver = LakeSolver(env)
    inf = solve(env)
    assert all(solver.action(s, 40) == a for s, a in inf.items())
    assert solver.path(0, 6) and len(solver.path(0, 6)) == 6
    assert success_probability(env, horizon=6) == 1.0 and success_probability(env, horizon=5) == 0.0


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(2, 5),
    p=st.sampled_from([0.5, 0.7, 0.9]),
    seed=st.integers(0, 10_000),
    success_rate=st.sampled_from([1 / 3, 0.5, 0.8, 1.0]),
    slippery=st.booleans(),
    horizon=st.integers(0, 30),
    per_turn=st.integers(1, 3),
)
def test_finite_horizon_optimum_properties(size, p, seed, success_rate, slippery, horizon, per_turn):
    env = FrozenLakeEnv(size=size, p=p, is_slippery=slippery, success_rate=success_rate)
    env.reset(seed=seed)
    solver = LakeSolver(env)
    v = success_probability(env, horizon)
    # at least what the infinite-horizon policy achieves within the same cap, at most its unlimited value
    assert v >= policy_success_probability(env, horizon) - 1e-12
    assert v <= success_probability(env) + 1e-9
    assert success_probability(env, horizon + 1) >= v - 1e-12  # more moves never hurt
    # the finite-horizon policy attains V_H exactly (evaluated by its own state distribution)
    model, dist, won = solver.model, np.zeros(len(solver.model.goal)), 0.0
    dist[model.start] = 1.0
    for left in range(horizon, 0, -1):
        acts = np.array([solver.action(s, left) - 1 for s in range(len(dist))])
        idx = np.arange(len(dist))
        won += float(dist @ model.goal_prob[acts, idx])
        dist = dist @ model.trans[acts, idx]
    assert won == pytest.approx(v, abs=1e-9)
    # turn-structured play: between one move per turn and closed-loop play over every move
    turns = max(1, horizon // per_turn)
    moves = turns * per_turn
    u = turn_success_probability(env, turns, per_turn)
    assert success_probability(env, turns) - 1e-12 <= u <= success_probability(env, moves) + 1e-12
    assert turn_success_probability(env, turns, 1) == pytest.approx(success_probability(env, turns), abs=1e-15)
    if solver.model.deterministic:  # open loop loses nothing on deterministic ice
        assert u == pytest.approx(success_probability(env, moves), abs=1e-12)


def test_own_slip_draw_gives_each_group_member_its_own_reproducible_slips():
    """``own_slip_draw``: the envs of a group (same seed) start on the same map, but on slippery ice each member meets
    its own slips, reproducibly; the default shares the group's slips; without slips the option changes nothing."""

    def episodes(env, seed, members=4):
        out = []
        for j in range(members):
            out.append(_walk(env, env.reset(seed=seed, options={"group_member": j})[0], [DOWN, RIGHT] * 6))
        return out

    shared, own = FrozenLakeEnv(size=5), FrozenLakeEnv(size=5, own_slip_draw=True)
    differ = 0
    for seed in range(20):
        a, b = episodes(own, seed), episodes(shared, seed)
        assert a == episodes(own, seed)  # reproducible
        assert len({e[0] for e in a + b}) == 1  # one start map for every member, either way
        assert all(e == b[0] for e in b)  # shared: the same actions meet the same slips
        differ += any(e != a[0] for e in a)
    assert differ >= 15  # P(4 members slip alike on every step) is small: most groups differ
    ice = FrozenLakeEnv(size=5, is_slippery=False, own_slip_draw=True)
    assert episodes(ice, 3) == episodes(FrozenLakeEnv(size=5, is_slippery=False), 3)
    with pytest.raises(ValueError, match="options\\['group_member'\\] must be an int >= 0"):
        own.reset(seed=0, options={"group_member": "1"})


def test_random_map_is_gymnasiums_map_and_gives_up_instead_of_hanging():
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    from ragen.envs.frozen_lake import MAP_TRIES, random_map

    for size, p, seed in [(2, 0.8, 0), (4, 0.8, 1), (4, 0.5, 7), (6, 0.6, 3), (8, 0.8, 11), (5, 1.0, 2)]:
        assert random_map(size, p, seed) == generate_random_map(size=size, p=p, seed=seed)
    # gymnasium's loop never ends here (a path needs every tile of a 4x4 board's route frozen at p = 1e-4)
    with pytest.raises(ValueError, match=f"no 4x4 map with a path from start to goal in {MAP_TRIES} tries at p=0.0001"):
        FrozenLakeEnv(size=4, p=1e-4).reset(seed=0)


# -- infinite horizon: the exact solve -----------------------------------------------------------


def _reference_value_iteration(model, tol=1e-12, max_iters=100_000, long_tol=1e-15, long_iters=300_000):
    """REFERENCE ONLY (not the solver): plain value iteration from 0 with a stopping rule of ``tol``, and the same
    iteration run on past that point to a tighter one.

    Returns ``(old, long)``: ``old = (values, policy, converged)``, what it returns at ``tol`` (``converged``:
    a sweep changed nothing by ``tol`` before the ``max_iters`` cap); ``long = (values, converged)``, the same
    iteration continued until a sweep changes nothing by ``long_tol`` (at most ``long_iters`` sweeps): value
    iteration from 0 creeps up on the optimum, and "changes nothing by 1e-12" left it up to ~4e-9 short.
    """
    from ragen.envs.frozen_lake.model import _first_best
    from ragen.envs.frozen_lake.policy_iteration import _rank_towards_goal

    n_states = len(model.goal)
    values = np.zeros(n_states)
    q = np.zeros((4, n_states))
    old = None
    for sweep in range(1, long_iters + 1):
        q = model.backup(values)
        new = q.max(axis=0)
        new[model.terminal] = 0.0
        delta = np.abs(new - values).max()
        values = new
        if old is None and (delta < tol or sweep == max_iters):  # where the old code stopped
            policy = _first_best(q)
            _rank_towards_goal(model, q, values, policy)
            old = (values.copy(), policy, bool(delta < tol))
        if old is not None and delta < long_tol:
            return old, (values, True)
    return old, (values, False)


def _fastest_reference(model, policy):
    """``(live, values, moves)`` of a policy (gym ids): the live states (those that can reach G at all), the
    policy's exact success probabilities and its expected moves until the episode ends (G, a hole, or a move off
    the live states), both by a linear solve over the live states, after checking the policy is proper on them."""
    from ragen.envs.frozen_lake.policy_iteration import _goal_reachers, _policy_values

    live = _goal_reachers(model)[0]
    assert np.all(_goal_reachers(model, policy)[0][live])  # from every live state G has a chance
    cells = np.flatnonzero(live)
    row = np.full(len(model.goal), -1)
    row[cells] = np.arange(len(cells))
    system, actions = np.eye(len(cells)), policy[cells]
    for succ, prob in zip(model.succ, model.prob):
        to, p = row[succ[actions, cells]], prob[actions, cells]
        on = (to >= 0) & (p > 0)
        np.add.at(system, (np.flatnonzero(on), to[on]), -p[on])
    moves = np.zeros(len(model.goal))
    moves[cells] = np.linalg.solve(system, np.ones(len(cells)))
    return live, _policy_values(model, policy, live, refine=True), moves


@pytest.mark.parametrize(
    "size, success_rate, seeds",
    [(4, 1 / 3, range(3)), (4, 0.9, range(3)), (5, 0.6, range(3)), (6, 1 / 3, range(2)), (6, 0.9, [1, 2]),
     (8, 0.9, range(2)), (10, 1 / 3, range(2)), (10, 0.9, [2])],
)
def test_infinite_values_equal_long_value_iteration_and_the_policy_is_no_slower_than_the_old_one(size, success_rate,
                                                                                                 seeds):
    """On random slippery maps: the solver's values are long value iteration's, its policy attains them, and from
    every state it ends the episode in no more expected moves than the old value iteration's policy (which broke
    its value ties by gym order alone: up to 1.4e8 times as many here, at 8x8 and success_rate 0.9)."""
    for seed in seeds:
        env = FrozenLakeEnv(size=size, success_rate=success_rate)
        env.reset(seed=seed)
        solver = LakeSolver(env)
        model, values, policy = solver.model, solver.infinite_values, solver.infinite_policy
        (old_values, old_policy, old_converged), (long_values, long_converged) = _reference_value_iteration(model)
        assert long_converged, seed
        np.testing.assert_allclose(values, long_values, rtol=0, atol=1e-9, err_msg=f"seed {seed}")
        assert np.all(values[model.terminal] == 0.0) and np.all((0.0 <= values) & (values <= 1.0))
        assert old_converged, seed
        live, own_values, moves = _fastest_reference(model, policy)
        np.testing.assert_allclose(own_values, values, rtol=0, atol=1e-13, err_msg=f"seed {seed}")
        old_moves = _fastest_reference(model, old_policy)[2]
        assert np.all(moves[live] <= old_moves[live] * (1 + 1e-9)), seed
        assert solve(env) == {int(s): int(policy[s]) + 1 for s in np.flatnonzero(~model.terminal)}


def test_value_ties_go_to_the_fewest_expected_moves_and_then_to_the_first_action():
    """A value tie goes to the action that ends the episode sooner; a tie in both to the first in gym order.

    In the second row's third cell of the first map Left and Down both reach the goal with probability 0.975 (0.95
    to a sure cell, 0.025 to another, 0.025 into a hole): the old value iteration's own error picked Down, the
    policy of gym order alone Left (3128 expected moves, Down 163): now Down. On a map symmetric about its
    diagonal, Down and Right from a diagonal cell are mirror images, equal in value and in expected moves (which
    come out up to ~3e-14 apart, either way round): Down, the first of them."""
    env = play(["SFHF", "FFFH", "FFFF", "HHFG"], success_rate=0.95)
    solver = LakeSolver(env)
    s = 1 * 4 + 2
    q = solver.model.backup(solver.infinite_values)[:, s]
    assert q[0] == pytest.approx(0.975, abs=1e-15) and q[1] == pytest.approx(0.975, abs=1e-15)
    assert solver.infinite_values[s] == pytest.approx(0.975, abs=1e-15)
    moves = _fastest_reference(solver.model, solver.infinite_policy)[2]
    cost = 1 + solver.model.expect(moves)[:, s]
    assert cost[1] < cost[0] / 10
    assert solver.action(s) == DOWN
    (_, old_policy, old_converged), _ = _reference_value_iteration(solver.model, long_tol=1e-12)
    assert old_converged and old_policy[s] + 1 == DOWN
    symmetric = ["SFFF", "FFFH", "FFFF", "FHFG"]
    assert all(row[j] == symmetric[j][i] for i, row in enumerate(symmetric) for j in range(4))
    for success_rate in [1 / 3, 0.6, 0.95]:
        solver = LakeSolver(play(symmetric, success_rate=success_rate))
        model = solver.model
        q = model.backup(solver.infinite_values)
        cost = 1 + model.expect(_fastest_reference(model, solver.infinite_policy)[2])
        for s in [0, 5, 10]:
            assert q[1, s] == pytest.approx(q[2, s], abs=1e-15) and cost[1, s] == pytest.approx(cost[2, s], rel=1e-12)
            assert cost[1, s] < min(cost[0, s], cost[3, s]), (success_rate, s)
            assert solver.action(s) == DOWN, (success_rate, s)


@pytest.mark.parametrize("size, seed, moves, margin", [(8, 0, 1_000, 0.05), (32, 0, 30_000, 0.01)])
def test_the_infinite_horizon_policy_reaches_the_goal_in_reasonable_time(size, seed, moves, margin):
    """At success_rate 0.9 the policy is optimal in value and gets there: from the start of the 8x8 map the goal
    within 1,000 moves with probability 0.967 of its 1.0 (370 expected moves), of the 32x32 one within 30,000 with
    0.874 of its 0.8814 (1.0e4 expected moves). Breaking value ties within 1e-9 by gym order alone, it took 2.0e8
    and 5.6e10 expected moves (the goal within those moves with probability 2.5e-6 and 4e-11), and on 32x32 its
    value was 0.065, losing up to 1e-9 a move."""
    env = FrozenLakeEnv(size=size, success_rate=0.9)
    env.reset(seed=seed)
    solver = LakeSolver(env)
    model, values, policy = solver.model, solver.infinite_values, solver.infinite_policy
    live, own_values, expected = _fastest_reference(model, policy)
    np.testing.assert_allclose(own_values[live], values[live], rtol=0, atol=1e-9)
    assert expected[model.start] < moves / 2
    reached = policy_success_probability(env, moves, {int(s): int(policy[s]) + 1 for s in np.flatnonzero(live)})
    assert reached > values[model.start] - margin


def test_infinite_values_with_dead_cells_and_an_unreachable_goal():
    # the top row can reach the goal only through holes: value exactly 0 there (no linear system for them)
    env = play(["SFH", "HHF", "FFG"], success_rate=0.8)
    values = LakeSolver(env).infinite_values
    assert values[0] == 0.0 and values[1] == 0.0
    assert values[5] > 0.5 and values[6] > 0 and values[7] > 0.5
    model = LakeModel.of(env)
    residual = model.backup(values).max(axis=0) - values
    assert np.abs(residual[~model.terminal]).max() < 1e-14
    # the goal walled off by holes: every value 0, and the policy still defined everywhere
    env = play(["SH", "HG"])
    assert success_probability(env) == 0.0 and set(solve(env)) == {0}


def test_infinite_horizon_is_solved_exactly_on_a_32x32_slippery_map():
    """At success_rate 0.9 on 32x32 the old value iteration stopped at its 100_000-sweep cap with a Bellman
    residual of 1.7e-10 on this map (values off by up to 2e-6); now the values are the optimum up to rounding."""
    env = FrozenLakeEnv(size=32, success_rate=0.9)
    env.reset(seed=2)
    solver = LakeSolver(env)
    model, values = solver.model, solver.infinite_values
    live = ~model.terminal
    residual = model.backup(values).max(axis=0) - values
    assert np.abs(residual[live]).max() < 1e-10
    assert np.all(values[model.terminal] == 0.0) and np.all((0.0 <= values) & (values <= 1.0))
    assert 0.9 < values[model.start] < 1.0


def test_describe_neighbours_names_where_each_action_leads():
    env = play(STANDARD, is_slippery=False, describe_neighbours=True)  # SFFF / FHFH / FFFH / HFFG
    obs = env.render()
    assert obs.split("\n")[:4] == ["P___", "_O_O", "___O", "O__G"]
    assert obs.split("\n")[4] == "Left: edge, Down: ice, Right: ice, Up: edge"
    assert obs in env.observation_space
    obs = env.step(RIGHT)[0]  # (0, 1): a hole below
    assert obs.split("\n")[4] == "Left: ice, Down: hole, Right: ice, Up: edge"
    for action in (RIGHT, DOWN, DOWN):  # (0,2) -> (1,2) -> (2,2): a hole right, the goal's column below
        obs = env.step(action)[0]
    assert obs.split("\n")[4] == "Left: ice, Down: ice, Right: hole, Up: ice"
    obs, reward, terminated, _, _ = env.step(DOWN)  # (3, 2): the goal to the right
    assert obs.split("\n")[4] == "Left: ice, Down: edge, Right: goal, Up: ice" and obs in env.observation_space
    assert not terminated and reward == 0.0


def test_describe_neighbours_changes_only_the_text():
    plain, described = play(STANDARD, is_slippery=False), play(STANDARD, is_slippery=False, describe_neighbours=True)
    for action in (DOWN, DOWN, RIGHT):
        a, b = plain.step(action), described.step(action)
        assert b[0].startswith(a[0] + "\n") and a[1:] == b[1:]
    plain_rgb = FrozenLakeEnv(render_mode="rgb_array", is_slippery=False)
    described_rgb = FrozenLakeEnv(render_mode="rgb_array", is_slippery=False, describe_neighbours=True)
    plain_rgb.reset(seed=3), described_rgb.reset(seed=3)
    assert np.array_equal(plain_rgb.render(), described_rgb.render())


def test_progress_reward_pays_each_step_closer_to_the_goal():
    env = play(STANDARD, is_slippery=False, progress_reward=0.1)  # SFFF / FHFH / FFFH / HFFG, goal at (3, 3)
    assert env.step(RIGHT)[1] == pytest.approx(0.1)  # 6 -> 5 cells from the goal
    assert env.step(UP)[1] == 0.0  # into the edge: no move, no progress
    assert env.step(LEFT)[1] == pytest.approx(-0.1)  # back: 5 -> 6
    for action in (RIGHT, RIGHT, DOWN, DOWN):
        env.step(action)
    obs, reward, terminated, _, info = env.step(RIGHT)  # (2, 2) -> (2, 3), a hole one cell from the goal
    assert reward == pytest.approx(0.1) and terminated and not info["success"]
    env = play(STANDARD, is_slippery=False, progress_reward=0.1)
    total = sum(env.step(a)[1] for a in (DOWN, DOWN, RIGHT, DOWN, RIGHT, RIGHT))
    assert total == pytest.approx(1.0 + 0.6)  # the goal's 1 and six cells of progress
    with pytest.raises(ValueError, match="progress_reward"):
        FrozenLakeEnv(progress_reward=-0.1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), slippery=st.booleans(), actions=st.lists(st.integers(1, 4), min_size=1, max_size=30))
def test_progress_reward_sums_to_the_distance_covered_whatever_the_moves(seed, slippery, actions):
    shaped, plain = FrozenLakeEnv(is_slippery=slippery, progress_reward=0.25), FrozenLakeEnv(is_slippery=slippery)
    shaped.reset(seed=seed), plain.reset(seed=seed)
    start, total, goal_total = shaped._goal_distance(shaped.state), 0.0, 0.0
    for action in actions:
        a, b = shaped.step(action), plain.step(action)
        assert a[0] == b[0] and a[2:] == b[2:]  # the same episode: only the reward differs
        total, goal_total = total + a[1], goal_total + b[1]
        if a[2] or a[3]:
            break
    assert total == pytest.approx(goal_total + 0.25 * (start - shaped._goal_distance(shaped.state)))
