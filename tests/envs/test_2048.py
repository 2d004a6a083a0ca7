"""2048 env: merge rules in all four directions, spawns, rewards, episode end, determinism, the expert."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ragen.envs.agents import ExpertAgent, RandomAgent, evaluate_agent, run_episode
from ragen.envs.game2048 import DOWN, LEFT, RIGHT, UP, Game2048Env, best_move, can_move, move, render_board, slide_row
from ragen.envs.registry import make

# A line moved towards its start (Left for a row): input, result, merged sum.
GOLDEN = [
    ([2, 2, 2, 2], [4, 4, 0, 0], 8),
    ([2, 2, 4, 0], [4, 4, 0, 0], 4),  # the new 4 does not merge again
    ([2, 2, 2, 0], [4, 2, 0, 0], 4),  # the pair nearest the wall merges
    ([4, 4, 8, 8], [8, 16, 0, 0], 24),
    ([0, 0, 0, 2], [2, 0, 0, 0], 0),
    ([2, 0, 0, 2], [4, 0, 0, 0], 4),
    ([4, 0, 4, 8], [8, 8, 0, 0], 8),
    ([2, 4, 8, 16], [2, 4, 8, 16], 0),
    ([8, 0, 8, 8], [16, 8, 0, 0], 16),
    ([0, 0, 0, 0], [0, 0, 0, 0], 0),
]


def put(line, action):
    """A 4x4 board with ``line`` read in the direction of ``action`` (towards the wall first) in row/column 1."""
    board = np.zeros((4, 4), dtype=np.int64)
    if action == LEFT:
        board[1, :] = line
    elif action == RIGHT:
        board[1, :] = line[::-1]
    elif action == UP:
        board[:, 1] = line
    else:
        board[:, 1] = line[::-1]
    return board


@pytest.mark.parametrize("line, expected, merged", GOLDEN)
@pytest.mark.parametrize("action", [UP, DOWN, LEFT, RIGHT])
def test_golden_lines_in_every_direction(line, expected, merged, action):
    assert slide_row(line) == (expected, merged)
    new, reward, changed = move(put(line, action), action)
    assert new.tolist() == put(expected, action).tolist()
    assert reward == merged
    assert changed == (expected != line)


def test_a_whole_board_in_each_direction():
    board = [[2, 2, 2, 2], [2, 2, 4, 0], [0, 0, 0, 2], [4, 4, 8, 8]]
    assert move(board, LEFT)[0].tolist() == [[4, 4, 0, 0], [4, 4, 0, 0], [2, 0, 0, 0], [8, 16, 0, 0]]
    assert move(board, RIGHT)[0].tolist() == [[0, 0, 4, 4], [0, 0, 4, 4], [0, 0, 0, 2], [0, 0, 8, 16]]
    assert move(board, UP)[0].tolist() == [[4, 4, 2, 4], [4, 4, 4, 8], [0, 0, 8, 0], [0, 0, 0, 0]]
    assert move(board, DOWN)[0].tolist() == [[0, 0, 0, 0], [0, 0, 2, 0], [4, 4, 4, 4], [4, 4, 8, 8]]
    assert [move(board, a)[1] for a in (LEFT, RIGHT, UP, DOWN)] == [36, 36, 12, 12]
    assert move(board, LEFT)[0] is not board and board[0] == [2, 2, 2, 2]  # pure


def test_render_is_aligned_with_dots():
    assert render_board([[2, 0], [128, 16]]) == "  2   .\n128  16"
    assert render_board([[0, 0], [0, 2]]) == ". .\n. 2"


def test_step_spawns_after_an_effective_move_only():
    env = Game2048Env(spawn_four_prob=0.0)
    env.reset(seed=0, options={"board": [[2, 2, 0, 0], [0] * 4, [0] * 4, [0] * 4]})
    obs, reward, terminated, truncated, info = env.step(LEFT)
    assert reward == 4.0 and info["action_is_effective"] and not terminated and not truncated
    r, c, v = info["spawned"]
    assert v == 2 and env.board[r, c] == 2 and (r, c) != (0, 0)
    assert int(env.board.sum()) == 6 and env.board[0, 0] == 4 and obs == render_board(env.board)


def test_ineffective_move_on_a_given_board():
    env = Game2048Env()
    env.reset(seed=0, options={"board": [[2, 4, 0, 0], [0] * 4, [0] * 4, [0] * 4]})
    obs, reward, terminated, truncated, info = env.step(LEFT)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert not info["action_is_effective"] and info["spawned"] is None and info["action_is_valid"]
    assert obs == "2 4 . .\n. . . .\n. . . .\n. . . ." and env.num_steps == 1


def test_reaching_the_target_is_success_and_ends_the_episode():
    env = Game2048Env(target=64)
    env.reset(seed=1, options={"board": [[32, 32, 0, 0], [0] * 4, [0] * 4, [0] * 4]})
    _, reward, terminated, truncated, info = env.step(RIGHT)
    assert reward == 64.0 and terminated and not truncated and info["success"] and info["max_tile"] == 64
    with pytest.raises(ValueError, match="episode is over"):
        env.step(LEFT)


def test_no_move_left_terminates_without_success():
    # One merge possible (the two 2s); after it the board is full with no equal neighbours.
    board = [[2, 2, 8, 16], [8, 16, 32, 64], [16, 32, 64, 128], [32, 64, 128, 256]]
    env = Game2048Env(spawn_four_prob=1.0)
    env.reset(seed=0, options={"board": board})
    obs, reward, terminated, truncated, info = env.step(LEFT)
    assert reward == 4.0 and info["spawned"] == (0, 3, 4)
    assert env.board[0].tolist() == [4, 8, 16, 4]
    assert terminated and not truncated and not info["success"] and not can_move(env.board)
    with pytest.raises(ValueError, match="episode is over"):
        env.step(UP)


def test_truncation_counts_ineffective_moves():
    env = Game2048Env(max_steps=2)
    env.reset(seed=0, options={"board": [[2, 4, 0, 0], [0] * 4, [0] * 4, [0] * 4]})
    assert not env.step(LEFT)[3]
    _, _, terminated, truncated, _ = env.step(LEFT)
    assert truncated and not terminated
    with pytest.raises(ValueError, match="episode is over"):
        env.step(RIGHT)


def test_reset_starts_with_two_tiles_and_seeds_are_deterministic():
    env = Game2048Env()
    obs, info = env.reset(seed=5)
    assert np.count_nonzero(env.board) == 2 and set(env.board[env.board > 0].tolist()) <= {2, 4}
    assert not info["success"]
    assert Game2048Env().reset(seed=5)[0] == obs
    assert len({Game2048Env().reset(seed=s)[0] for s in range(20)}) > 1

    def episode(seed):
        e = Game2048Env(max_steps=60)
        out = [e.reset(seed=seed)[0]]
        for a in [1, 3, 2, 4] * 15:
            obs, reward, terminated, truncated, info = e.step(a)
            out.append((obs, reward, info["spawned"]))
            if terminated or truncated:
                break
        return out

    assert episode(9) == episode(9)
    assert episode(9) != episode(10)


def test_check_env_registry_and_parse_action():
    check_env(Game2048Env())
    check_env(Game2048Env(size=3, target=256, render_mode="text"))
    env = make("game2048")
    assert isinstance(env, Game2048Env)
    assert [env.parse_action(t) for t in ["Up", "down", " LEFT ", "Right", "north", ""]] == [UP, DOWN, LEFT, RIGHT, None, None]
    assert "2048" in env.instructions and "Up, Down, Left, Right" in env.instructions
    assert env.render() == ""  # before reset


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"size": 1}, "size"),
        ({"target": 3}, "target"),
        ({"target": 2}, "target"),
        ({"target": 100}, "target"),
        ({"target": 0}, "target"),
        ({"spawn_four_prob": 1.5}, "spawn_four_prob"),
        ({"spawn_four_prob": -0.1}, "spawn_four_prob"),
        ({"spawn_four_prob": float("nan")}, "spawn_four_prob"),
        ({"max_steps": 0}, "max_steps"),
        ({"size": 4.0}, "size"),
        ({"goal": 2048}, "unknown config key"),
    ],
)
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        Game2048Env(**cfg)


@pytest.mark.parametrize(
    "board, match",
    [
        ([[2, 0, 0]], "4x4"),
        ([[3, 0, 0, 0], [0] * 4, [0] * 4, [0] * 4], "powers of two"),
        ([[2048, 0, 0, 0], [0] * 4, [0] * 4, [0] * 4], "powers of two"),
        ([[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2]], "no possible move"),
        ([[0] * 4] * 4, "no possible move"),
        ("abcd", "rows of"),
    ],
)
def test_bad_boards(board, match):
    with pytest.raises(ValueError, match=match):
        Game2048Env().reset(options={"board": board})


def test_bad_action_and_render_mode():
    env = Game2048Env()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="invalid action id"):
        env.step(5)
    with pytest.raises(ValueError, match="render_mode"):
        Game2048Env(render_mode="rgb_array")


# --- properties ------------------------------------------------------------------------------

TILES = st.sampled_from([0, 0, 0, 2, 2, 4, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
BOARDS = st.lists(TILES, min_size=16, max_size=16).map(lambda cells: np.array(cells, dtype=np.int64).reshape(4, 4))


def merged_value(before: np.ndarray, after: np.ndarray) -> int:
    """Sum of the tiles created by merges, from the tile multisets alone (independent of the move code).

    Merging two v tiles removes two v and adds one 2v, so from the smallest value up the number
    of v-merges is m_v = (count_before[v] + m_{v/2} - count_after[v]) / 2.
    """
    cb, ca = Counter(before[before > 0].tolist()), Counter(after[after > 0].tolist())
    total, carried, v = 0, 0, 2
    while v <= max([*cb, *ca, 2]):
        m2 = cb[v] + carried - ca[v]
        assert m2 >= 0 and m2 % 2 == 0
        carried = m2 // 2
        total += 2 * v * carried
        v *= 2
    return total


@settings(max_examples=200, deadline=None)
@given(board=BOARDS, action=st.sampled_from([UP, DOWN, LEFT, RIGHT]))
def test_move_properties(board, action):
    new, reward, changed = move(board, action)
    assert int(new.sum()) == int(board.sum())  # sliding conserves the tile sum
    assert reward == merged_value(board, new)
    assert changed == (not (new == board).all())
    merges = np.count_nonzero(board) - np.count_nonzero(new)
    assert merges >= 0 and (reward == 0) == (merges == 0) and reward >= 4 * merges
    assert all(is_power_of_two(int(v)) for v in new[new > 0])
    # Symmetries: Right is Left on the mirrored board, Up is Left on the transpose.
    if action == RIGHT:
        assert (new == move(board[:, ::-1], LEFT)[0][:, ::-1]).all()
    if action == UP:
        assert (new == move(board.T, LEFT)[0].T).all()
    if action == DOWN:
        assert (new == move(board[::-1], UP)[0][::-1]).all()
    # Tiles end packed against the wall they move towards: no empty cell before a tile.
    packed = {LEFT: new, RIGHT: new[:, ::-1], UP: new.T, DOWN: new.T[:, ::-1]}[action]
    for line in packed:
        nonzero = np.flatnonzero(line)
        assert (nonzero == np.arange(len(nonzero))).all()


def is_power_of_two(v: int) -> bool:
    return v >= 2 and v & (v - 1) == 0


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    actions=st.lists(st.sampled_from([UP, DOWN, LEFT, RIGHT]), min_size=1, max_size=80),
    four=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
)
def test_random_play_keeps_invariants(seed, actions, four):
    env = Game2048Env(spawn_four_prob=four, target=256, max_steps=1000)
    env.reset(seed=seed)
    score = 0.0
    for action in actions:
        before = env.board.copy()
        obs, reward, terminated, truncated, info = env.step(action)
        after = env.board
        score += reward
        assert obs in env.observation_space and obs == render_board(after)
        assert all(is_power_of_two(int(v)) for v in after[after > 0])
        assert info["score"] == score and info["max_tile"] == int(after.max())
        if info["action_is_effective"]:
            r, c, v = info["spawned"]
            assert v == {0.0: 2, 1.0: 4}[four] if four in (0.0, 1.0) else v in (2, 4)
            assert before.sum() + v == after.sum()  # the tile sum grows by exactly the spawned tile
            unspawned = after.copy()
            unspawned[r, c] = 0
            assert reward == merged_value(before, unspawned)
            assert (unspawned == move(before, action)[0]).all()
        else:
            assert info["spawned"] is None and reward == 0.0
            assert (after == before).all()
        assert info["success"] == (after.max() >= 256)
        assert terminated == (info["success"] or not can_move(after))
        if terminated:
            break


@settings(max_examples=50, deadline=None)
@given(board=BOARDS)
def test_can_move_and_expert_move(board):
    assert can_move(board) == any(move(board, a)[2] for a in (UP, DOWN, LEFT, RIGHT))
    assume(can_move(board))
    assert move(board, best_move(board))[2]  # the expert never wastes a move


# --- baselines -------------------------------------------------------------------------------


def test_expert_beats_random_on_score():
    seeds = range(20)
    cfg = {"max_steps": 150}
    expert = evaluate_agent("game2048", cfg, ExpertAgent(), seeds, max_turns=150)
    random = evaluate_agent("game2048", cfg, RandomAgent(seed=0), seeds, max_turns=150)
    assert expert["invalid_turns_mean"] == random["invalid_turns_mean"] == 0.0
    assert expert["reward_mean"] > 1.5 * random["reward_mean"], (expert, random)
    assert expert["reward_mean"] - 2 * expert["reward_std"] > random["reward_mean"]


def test_expert_reaches_a_small_target_and_answers_one_move():
    env = make("game2048", target=256)
    for seed in range(3):
        result = run_episode(env, ExpertAgent(), seed=seed, max_turns=400)
        assert result["success"], seed
    env.reset(seed=0)
    answers = ExpertAgent().act(env)
    assert len(answers) == 1 and env.parse_action(answers[0]) is not None


def test_own_spawn_draw_gives_each_group_member_its_own_reproducible_spawns():
    """``own_spawn_draw``: the envs of a group (same seed) start on the same board, then each member meets its own
    spawned tiles, reproducibly; the default shares the group's spawns."""

    def spawns(env, seed, members=4):
        out = []
        for member in range(members):
            obs, _ = env.reset(seed=seed, options={"group_member": member})
            steps = [obs]
            for action in [UP, LEFT, DOWN, RIGHT] * 3:
                _, _, terminated, truncated, info = env.step(action)
                steps.append(info["spawned"])
                if terminated or truncated:
                    break
            out.append(steps)
        return out

    shared, own = Game2048Env(), Game2048Env(own_spawn_draw=True)
    for seed in range(10):
        a, b = spawns(own, seed), spawns(shared, seed)
        assert a == spawns(own, seed)  # reproducible
        assert len({e[0] for e in a + b}) == 1  # one start board for every member, either way
        assert all(e == b[0] for e in b)  # shared: the same moves meet the same spawns
        assert any(e != a[0] for e in a)  # own: four members meeting the same 12 spawns by chance is ~impossible
    with pytest.raises(ValueError, match="options\\['group_member'\\] must be an int >= 0"):
        own.reset(seed=0, options={"group_member": True})
