"""Env size bounds, the FrozenLake expert's plans and policies, RandomAgent seeding, 2048 boards."""

from __future__ import annotations

import tracemalloc
from collections import deque
from functools import lru_cache

import numpy as np
import pytest

import ragen.envs
from ragen.envs.agents import ExpertAgent, RandomAgent, run_episode
from ragen.envs.frozen_lake import TIE, LakeSolver, solve
from ragen.envs.game2048 import best_move

LETTERS = {1: "L", 2: "D", 3: "R", 4: "U"}  # FrozenLake's action ids

# -- 1. size bounds ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [33, 10**6])
def test_frozen_lake_size_beyond_the_bound_is_a_config_error(size):
    """``size=10**6`` made ``reset`` try to allocate a 7 TiB board; 2000 had not finished after 30 s."""
    with pytest.raises(ValueError, match="frozen_lake: size must be in 2..32"):
        ragen.envs.make("frozen_lake", size=size)


@pytest.mark.parametrize("dim_room", [(33, 6), (6, 33), (10**6, 10**6)])
def test_sokoban_dim_room_beyond_the_bound_is_a_config_error(dim_room):
    """``dim_room=(10**6, 10**6)`` hung ``reset``; (2000, 2000) took 11 s."""
    with pytest.raises(ValueError, match="sokoban: dim_room must be at most 32x32"):
        ragen.envs.make("sokoban", dim_room=dim_room)


@pytest.mark.parametrize("size", [17, 10**6])
def test_2048_size_beyond_the_bound_is_a_config_error(size):
    """``size=10**6`` made ``reset`` try to allocate a 7 TiB board."""
    with pytest.raises(ValueError, match="game2048: size must be in 2..16"):
        ragen.envs.make("game2048", size=size)


def test_every_env_plays_at_its_size_bound_with_its_expert():
    """The bounds are not below what works: reset, and the expert's answer, at each bound."""
    lake = ragen.envs.make("frozen_lake", size=32, is_slippery=False, max_steps=200)
    assert run_episode(lake, ExpertAgent(), seed=0, max_turns=1)["success"]  # the whole path in one turn
    room = ragen.envs.make("sokoban", dim_room=(32, 32))
    assert run_episode(room, ExpertAgent(), seed=0, max_turns=1)["success"]
    game = ragen.envs.make("game2048", size=16)
    game.reset(seed=0)
    assert game.step(best_move(game.board))[4]["action_is_effective"]


# -- 2. the FrozenLake expert ------------------------------------------------------------------


def _bfs_length(desc: list[str]) -> int | None:
    """Moves on the shortest path from S to G avoiding holes (None: no path)."""
    start = next((r, c) for r, row in enumerate(desc) for c, ch in enumerate(row) if ch == "S")
    dist, queue = {start: 0}, deque([start])
    while queue:
        r, c = queue.popleft()
        if desc[r][c] == "G":
            return dist[r, c]
        for nr, nc in ((r, c - 1), (r + 1, c), (r, c + 1), (r - 1, c)):
            if 0 <= nr < len(desc) and 0 <= nc < len(desc[0]) and desc[nr][nc] != "H" and (nr, nc) not in dist:
                dist[nr, nc] = dist[r, c] + 1
                queue.append((nr, nc))
    return None


def _expert_moves(env, seed: int) -> str:
    """The expert's whole deterministic-ice episode as letters (the rollout's default budget of 100 turns)."""
    result = run_episode(env, ExpertAgent(), seed=seed, record=True)
    assert result["success"]
    return "".join(action[0] for turn in result["transcript"] for action in turn["actions"])


#: The expert's plans on deterministic ice before the sparse rewrite (captured from the dense solver).
OLD_PLANS = {
    (4, 0): "DDRRDR",
    (4, 1): "DDDRRR",
    (8, 0): "DDDDDRRRRRDRRD",
    (8, 1): "DDDDDRRDDRRRRR",
    (16, 0): "DDDDDDDRDRDDDDDRRRRRRRRDRDRRRR",
    (16, 1): "DDRRDDDDRDRRRRDDDDDDDRRRRRDRRR",
}

#: Reference optimal policies on slippery ice from plain policy iteration, per state ("." terminal): ``solve`` breaks
#: ties among optimal actions differently, so it is held to their values, not their letters.
OLD_POLICIES = {
    (4, 0): "L.L.LDDDDULLL.R.",
    (4, 1): "LL.LLLL.LLDDDDD.",
    (6, 0): "L.L.RLLDDDRUL.RUL.LDL.RDLLL.RDDDDDD.",
    (8, 0): "L.RRL..LLL.RLDL.LDDRLLL.LL.RLDDDL.DRLLLLDDDDULLLLLUL.RULLL.RDL..",
}


@pytest.mark.parametrize("size, seed", sorted(OLD_PLANS))
def test_lake_expert_plans_are_unchanged_and_shortest(size, seed):
    env = ragen.envs.make("frozen_lake", size=size, is_slippery=False)
    moves = _expert_moves(env, seed)
    assert moves == OLD_PLANS[size, seed]
    assert len(moves) == _bfs_length(env.desc)


def test_lake_expert_plans_are_shortest_on_many_maps():
    for size in (4, 6, 8, 10, 12):
        env = ragen.envs.make("frozen_lake", size=size, is_slippery=False)
        for seed in range(8):
            assert len(_expert_moves(env, seed)) == _bfs_length(env.desc), (size, seed)


@pytest.mark.parametrize("size, seed", sorted(OLD_POLICIES))
def test_lake_infinite_horizon_policy_is_as_good_as_before_the_rewrite_and_no_slower(size, seed):
    """``solve`` takes, among the optimal actions, those that end the episode soonest: its policy is optimal -- its
    exact success probability from every state is the reference policy's (optimal on these maps) within 1e-12 -- and
    ends the episode in no more expected moves."""
    from ragen.envs.frozen_lake import LakeModel
    from ragen.envs.frozen_lake.policy_iteration import _expected_moves, _goal_reachers, _policy_values

    env = ragen.envs.make("frozen_lake", size=size, is_slippery=True)
    env.reset(seed=seed)
    policy = solve(env)
    model = LakeModel.of(env)
    ids = {letter: action for action, letter in LETTERS.items()}
    new = np.array([policy.get(s, 1) - 1 for s in range(size * size)])  # gym action ids 0..3; terminal cells: any
    old = np.array([ids.get(c, 1) - 1 for c in OLD_POLICIES[size, seed]])
    live = _goal_reachers(model)[0]
    new_values, old_values = (_policy_values(model, p, live, refine=True) for p in (new, old))
    assert np.all(new_values >= old_values - 1e-12), (new_values - old_values).min()
    new_moves, old_moves = (_expected_moves(model, p, live) for p in (new, old))
    assert np.all(new_moves[live] <= old_moves[live] * (1 + 1e-9))


def _expectimax_q(lake, state: int, moves: int) -> list[float]:
    """Brute force over gymnasium's ``P``: per gym action, the best chance of reaching G within ``moves`` moves."""

    @lru_cache(maxsize=None)
    def value(s: int, k: int) -> float:
        return 0.0 if k == 0 else max(q(s, k))

    def q(s: int, k: int) -> list[float]:
        out = []
        for a in range(4):
            total = 0.0
            for p, s2, _, done in lake.P[s][a]:
                cell = lake.desc.ravel()[s2]
                total += p * (1.0 if cell == b"G" else 0.0 if done else value(s2, k - 1))
            out.append(total)
        return out

    return q(state, moves)


@pytest.mark.parametrize("seed", range(4))
def test_lake_finite_horizon_choices_are_optimal_against_brute_force(seed):
    env = ragen.envs.make("frozen_lake", size=4, is_slippery=True)
    env.reset(seed=seed)
    solver = LakeSolver(env)
    for state in np.flatnonzero(~solver.model.terminal):
        for moves in range(1, 7):
            q = _expectimax_q(env.lake, int(state), moves)
            assert solver.values(moves)[state] == pytest.approx(max(q), abs=1e-12)
            assert q[solver.action(int(state), moves) - 1] >= max(q) - 1e-12, (state, moves)


def test_lake_expert_breaks_mirror_image_ties_the_same_way_at_every_horizon():
    """On a map symmetric about its diagonal, Down and Right from the start are equally good at every horizon.
    The dense solver's ``argmax`` chose between them by rounding noise, so its choice flickered with the horizon
    (``DDDDRRDRDDR...``) and differed between CPUs' BLAS kernels; now the first of tied actions (Down) is kept."""
    env = ragen.envs.make("frozen_lake", is_slippery=True)
    env.reset(seed=0, options={"map": ["SFFF", "FFFF", "FFFF", "FFFG"]})
    solver = LakeSolver(env)
    for moves in range(6, 61):
        q = solver.q_values(moves)[:, solver.model.start]
        assert abs(q[1] - q[2]) <= TIE and q[1:3].min() >= q.max() - TIE  # Down and Right tie at the top
        assert solver.action(solver.model.start, moves) == 2, moves  # Down


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_lake_solver_never_builds_the_dense_transition_table():
    """The solver kept a dense ``(4, n, n)`` table (``32 n^2`` bytes: 10.6 MB at 24x24, 537 MB at 64x64) and
    multiplied by it every sweep: the expert took ~20 s on a slippery 24x24 map. Peak traced memory was 12.6 MB
    here; the sparse table keeps it a fraction of the dense table's size."""
    env = ragen.envs.make("frozen_lake", size=24, is_slippery=False)
    env.reset(seed=0)
    n = 24 * 24
    assert _peak_bytes(lambda: LakeSolver(env).path(0, 200)) < 32 * n * n / 2


def test_lake_turn_plans_never_build_a_matrix_per_move_sequence():
    """Turns of several moves on slippery ice kept an ``n x n`` matrix for each of the 4**4 four-move sequences
    (58 MB peak at 12x12, 680 MB at 24x24); now each candidate's score is one vector."""
    env = ragen.envs.make("frozen_lake", size=12, is_slippery=True)
    env.reset(seed=0)
    solver = LakeSolver(env)
    assert _peak_bytes(lambda: solver.turn_plan(solver.model.start, 3, 12, 4)) < 8e6


# -- 3. RandomAgent seeding --------------------------------------------------------------------


def _draws(agent: RandomAgent, env, seed: int) -> list[int]:
    agent.begin_episode(env, seed)
    return agent.rng.integers(2**30, size=4).tolist()


def test_random_agent_tells_apart_episode_seeds_that_differ_above_32_bits():
    """The episode seed was masked to its low 32 bits: seeds 5, 5 + 2**32 and 5 + 2**40 (different maps) replayed
    the same actions."""
    env = ragen.envs.make("frozen_lake")
    agent = RandomAgent(seed=0)
    draws = [tuple(_draws(agent, env, seed)) for seed in (5, 5 + 2**32, 5 + 2**40)]
    assert len(set(draws)) == 3


def test_random_agent_keeps_its_draws_for_seeds_below_2_to_the_32():
    """Seeds that fit 32 bits draw as before (``default_rng([agent seed, episode seed])``): baselines stay put."""
    env = ragen.envs.make("frozen_lake")
    for seed in (0, 1, 2**31, 2**32 - 1):
        old = np.random.default_rng([7, seed]).integers(2**30, size=4).tolist()
        assert _draws(RandomAgent(seed=7), env, seed) == old


def test_random_agent_refuses_a_negative_episode_seed():
    """Masking made -1 an alias of 2**32 - 1; gymnasium's ``reset`` refuses negative seeds, and so does the agent."""
    with pytest.raises(ValueError, match="episode seed must be an int >= 0"):
        RandomAgent(seed=0).begin_episode(ragen.envs.make("frozen_lake"), -1)


# -- 4. 2048 boards ----------------------------------------------------------------------------


@pytest.mark.parametrize("tile", [2.5, 4.7, float("inf"), float("nan"), True], ids=["2.5", "4.7", "inf", "nan", "True"])
def test_2048_board_tile_that_is_not_a_whole_number_is_an_error(tile):
    """``int()`` made 2.5 a 2 tile and 4.7 a 4 without a word; inf raised a bare OverflowError, True became a 1."""
    board = [[2, 0, 0, 0], [0, tile, 0, 0], [0] * 4, [0] * 4]
    with pytest.raises(ValueError, match=r"game2048: board must be 4 rows of 4 ints .*row 1 holds .* not a whole"):
        ragen.envs.make("game2048").reset(seed=0, options={"board": board})


def test_2048_board_of_whole_floats_still_plays():
    """A float array holding whole numbers (``np.zeros`` then tiles set) is a fine board."""
    board = np.zeros((4, 4))
    board[0, :2] = 2.0
    env = ragen.envs.make("game2048")
    env.reset(seed=0, options={"board": board})
    assert env.board.dtype == np.int64 and env.board[0].tolist() == [2, 2, 0, 0]
