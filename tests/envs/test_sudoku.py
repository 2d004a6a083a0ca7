"""Sudoku env: rules, rewards, unique generated puzzles, solver, parse_action, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen.envs.registry import make
from ragen.envs.sudoku import SudokuEnv, _conflicts, count_solutions, decode, encode, render_grid, solve

SOLUTION = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
PUZZLE = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 0, 0]]  # last two cells empty: 2 then 1


def play(grid=PUZZLE, **cfg) -> SudokuEnv:
    env = SudokuEnv(**cfg)
    env.reset(options={"grid": grid})
    return env


def move(env: SudokuEnv, text: str):
    action = env.parse_action(text)
    assert action is not None, text
    return env.step(action)


def test_check_env_and_registry():
    check_env(SudokuEnv())
    check_env(SudokuEnv(size=9, num_holes=30))
    assert isinstance(make("sudoku"), SudokuEnv)


def test_render():
    assert render_grid(PUZZLE) == "1 2 | 3 4\n3 4 | 1 2\n----+----\n2 1 | 4 3\n4 3 | . ."


def test_legal_fill_then_solve():
    env = play()
    obs, reward, terminated, _, info = move(env, "r4c3=2")
    assert reward == 0.0 and not terminated and info["action_is_effective"] and not info["illegal"]
    assert obs.endswith("4 3 | 2 .")
    obs, reward, terminated, truncated, info = move(env, "r4c4=1")
    assert reward == 1.0 and terminated and not truncated and info["success"]
    with pytest.raises(ValueError, match="episode is over"):
        move(env, "r4c4=1")


@pytest.mark.parametrize("text", ["r4c3=1", "r4c3=3", "r1c1=2", "r4c4=4"])
def test_illegal_moves_are_rejected(text):
    env = play()
    before = env.render()
    obs, reward, terminated, _, info = move(env, text)
    assert reward == -0.1 and obs == before and info["illegal"] and not info["action_is_effective"]
    assert info["action_is_valid"] and not terminated


def test_overwrite_own_entry_and_same_value():
    grid = [[0, 0, 0, 0], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
    env = play(grid)
    assert move(env, "r1c1=1")[4]["action_is_effective"]
    _, reward, _, _, info = move(env, "r1c1=1")
    assert reward == 0.0 and not info["action_is_effective"] and not info["illegal"]
    # Can't write 2 at r1c1 now? Column 1 has 3, 2, 4 -> 2 conflicts.
    assert move(env, "r1c1=2")[1] == -0.1


def test_truncation():
    env = play(max_steps=2)
    assert not move(env, "r1c1=2")[3]
    assert move(env, "r1c1=2")[3]


def test_parse_action_formats():
    env = SudokuEnv()
    expected = encode(2, 3, 4, 4)
    for text in ["r2c3=4", "R2C3 = 4", " r2 c3=4 ", "row2col3:4", "(r2,c3)=4", "(r2, c3)=4"]:
        assert env.parse_action(text) == expected, text
        assert env.action_lookup[expected] == "r2c3=4"
    for text in ["r5c1=1", "r1c1=5", "r0c1=1", "2,3=4", "", "Up"]:
        assert env.parse_action(text) is None, text
    assert decode(expected, 4) == (1, 2, 4)
    assert len(env.action_lookup) == 64 and len(SudokuEnv(size=9).action_lookup) == 729


@pytest.mark.parametrize("size, holes", [(4, 8), (4, 10), (9, 40)])
def test_generated_puzzles_are_unique_and_consistent(size, holes):
    for seed in range(5 if size == 9 else 20):
        env = SudokuEnv(size=size, num_holes=holes)
        env.reset(seed=seed)
        assert int((env.grid == 0).sum()) == holes
        assert count_solutions(env.grid) == 1
        assert solve(env.grid) == env.solution.tolist()
        assert (env.solution[env.givens] == env.grid[env.givens]).all()
        for r in range(size):
            assert sorted(env.solution[r]) == list(range(1, size + 1))
            assert sorted(env.solution[:, r]) == list(range(1, size + 1))


def test_solution_plays_to_success():
    env = SudokuEnv(size=9, num_holes=30)
    env.reset(seed=3)
    total = 0.0
    for r, c in zip(*np.nonzero(env.grid == 0)):
        _, reward, terminated, _, info = move(env, f"r{r + 1}c{c + 1}={env.solution[r, c]}")
        total += reward
    assert terminated and info["success"] and total == 1.0


def test_same_seed_same_puzzle():
    assert SudokuEnv().reset(seed=11)[0] == SudokuEnv().reset(seed=11)[0]
    assert len({SudokuEnv().reset(seed=s)[0] for s in range(10)}) > 1


def test_solver():
    assert solve(PUZZLE) == SOLUTION
    assert count_solutions([[0] * 4 for _ in range(4)], limit=5) == 5
    assert solve([[1, 1, 0, 0], [0] * 4, [0] * 4, [0] * 4]) is None


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), actions=st.lists(st.integers(1, 64), min_size=1, max_size=60))
def test_random_play_keeps_invariants(seed, actions):
    env = SudokuEnv(max_steps=1000)
    env.reset(seed=seed)
    givens = env.grid[env.givens].copy()
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert reward in (-0.1, 0.0, 1.0)
        assert obs in env.observation_space
        assert (env.grid[env.givens] == givens).all()
        for r, c in zip(*np.nonzero(env.grid)):
            assert not _conflicts(env.grid, int(r), int(c), int(env.grid[r, c]))
        assert info["success"] == bool((env.grid > 0).all())
        if terminated:
            assert (env.grid == env.solution).all()
            break


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"size": 5}, "size"),
        ({"size": 1}, "size"),
        ({"num_holes": 0}, "num_holes"),
        ({"num_holes": 16}, "num_holes"),
        ({"max_steps": 0}, "max_steps"),
        ({"holes": 3}, "unknown config key"),
    ],
)
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        SudokuEnv(**cfg)


def test_too_many_holes_for_uniqueness():
    with pytest.raises(ValueError, match="unique solution"):
        SudokuEnv(num_holes=14, max_generation_tries=3).reset(seed=0)


@pytest.mark.parametrize(
    "grid, match",
    [
        ([[1, 2, 3]], "4x4"),
        ([[1, 1, 0, 0], [0] * 4, [0] * 4, [0] * 4], "conflict at r1c1"),
        ([[5, 0, 0, 0], [0] * 4, [0] * 4, [0] * 4], "values"),
        ("abcd", "rows of"),
    ],
)
def test_bad_grids(grid, match):
    with pytest.raises(ValueError, match=match):
        SudokuEnv().reset(options={"grid": grid})


def test_bad_action():
    env = play()
    with pytest.raises(ValueError, match="invalid action id"):
        env.step(65)


def test_a_grid_without_an_empty_cell_is_refused():
    """A full solution used to start an episode whose first move "succeeded" with reward -0.1 and ``illegal``."""
    with pytest.raises(ValueError, match="sudoku: options\\['grid'\\] has no empty cell"):
        SudokuEnv().reset(options={"grid": SOLUTION})
    assert play(PUZZLE).step(encode(4, 3, 2, 4))[1] == 0.0  # one hole is enough


def test_parse_action_refuses_huge_and_non_ascii_digit_runs():
    """``int()`` raised on a run of over 4300 digits, and ``\\d`` read other scripts' digits (``r1c1=١`` was 1)."""
    env = SudokuEnv(size=9)
    assert env.parse_action("r1c1=" + "1" * 5000) is None
    assert env.parse_action("r" + "0" * 5000 + "1c1=1") is None
    for text in ["r1c1=\u0661", "r\u0661c1=1", "r1c\uff11=1", "r1c1=\u0967", "r1c1=\U0001d7d9"]:
        assert env.parse_action(text) is None, text
    assert env.parse_action("r01c001=9") == encode(1, 1, 9, 9)


#: Digit runs: one digit of any script (``١``, ``１``, ``𝟙``), a short mixed run, short ASCII runs, and ASCII runs
#: around ``int()``'s 4300-digit limit.
_DIGITS = (
    st.characters(categories=["Nd"])
    | st.text(alphabet=st.characters(categories=["Nd"]), min_size=1, max_size=4)
    | st.from_regex(r"\A[0-9]{1,4}\Z")
    | st.integers(4290, 6000).map(lambda n: "0" * (n - 1) + "1")
)


@settings(max_examples=300, deadline=None)
@given(
    size=st.sampled_from([4, 9]),
    text=st.text(max_size=80)
    | st.builds(lambda r, c, v, sep: f"r{r}c{c}{sep}{v}", _DIGITS, _DIGITS, _DIGITS, st.sampled_from(["=", ":", " = "])),
)
def test_parse_action_never_raises_and_returns_a_valid_id_or_none(size, text):
    """Any model text is a move id in ``action_lookup`` or None (a format penalty), never an exception; an id
    comes only from ASCII digits."""
    env = SudokuEnv(size=size)
    action = env.parse_action(text)
    assert action is None or action in env.action_lookup
    if action is not None:
        assert all(ch.isascii() for ch in text if ch.isdigit())
