"""Sokoban env: gymnasium API, gym-sokoban rules and rewards, generation, solver, bad input."""

from __future__ import annotations

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen.envs.registry import make
from ragen.envs.sokoban import LARGER_SOKOBAN, SIMPLE_SOKOBAN, SokobanEnv, parse_level, solve
from ragen.envs.sokoban.room import CODE_BOX, CODE_BOX_ON_TARGET, CODE_PLAYER

UP, DOWN, LEFT, RIGHT = 1, 2, 3, 4

ONE_PUSH_TO_WIN = """
######
#PXO_#
######
"""
TWO_BOXES = """
#######
#PXO__#
#__X_O#
#######
"""
BOX_ON_TARGET_THEN_BOX = """
#######
#P√_XO#
#######
"""
BOX_AGAINST_WALL = """
#####
#_PX#
#O__#
#####
"""
# Box needs 3 pushes in two directions: 1 move to get in place + 2 to switch sides = 6.
AROUND_THE_CORNER = """
######
#O___#
#__X_#
#___P#
######
"""
BOX_IN_CORNER = """
#####
#X__#
#_P_#
#__O#
#####
"""


def play(level: str, **cfg) -> SokobanEnv:
    env = SokobanEnv(**cfg)
    env.reset(options={"level": level})
    return env


# ---------------------------------------------------------------- gymnasium API


@pytest.mark.parametrize("observation_format", ["grid", "coord", "grid_coord"])
def test_check_env_passes(observation_format):
    env = SokobanEnv(observation_format=observation_format)
    check_env(env)
    check_env(SokobanEnv(observation_format=observation_format, render_mode="rgb_array"))
    obs, _ = env.reset(seed=3)
    assert obs in env.observation_space


def test_registered_and_presets():
    env = make("sokoban", **LARGER_SOKOBAN)
    assert isinstance(env, SokobanEnv)
    env.reset(seed=0)
    assert env.room.shape == (8, 8) and len(env.room.boxes) == 2
    assert SokobanEnv(**SIMPLE_SOKOBAN).config.dim_room == (6, 6)


def test_list_dim_room_is_accepted():
    env = SokobanEnv(dim_room=[7, 5])
    assert env.config.dim_room == (7, 5)
    obs, _ = env.reset(seed=0)
    assert [len(row) for row in obs.split("\n")] == [5] * 7


def test_observation_formats():
    grid_env = play(ONE_PUSH_TO_WIN)
    assert grid_env.render() == ONE_PUSH_TO_WIN.strip()
    coord_env = play(ONE_PUSH_TO_WIN, observation_format="coord")
    lines = coord_env.render().split("\n")
    assert lines[1:] == ["targets: (1, 3)", "boxes: (1, 2)", "player: (1, 1)"]
    assert lines[0].startswith("walls: (0, 0), (0, 1)")
    both = play(ONE_PUSH_TO_WIN, observation_format="grid_coord").render()
    assert both == grid_env.render() + "\n" + coord_env.render()


def test_instructions_and_actions():
    env = SokobanEnv()
    assert "push all boxes to targets" in env.instructions
    assert "Valid actions: Up, Down, Left, Right" in env.instructions
    assert "√: box on target" in env.instructions
    assert env.parse_action(" up ") == UP and env.parse_action("Jump") is None


def test_state_arrays_follow_gym_sokoban_codes():
    env = play(BOX_ON_TARGET_THEN_BOX)
    assert env.room_fixed.tolist()[1] == [0, 1, 2, 1, 1, 2, 0]
    assert env.room_state.tolist()[1] == [0, CODE_PLAYER, CODE_BOX_ON_TARGET, 1, CODE_BOX, 2, 0]


# ---------------------------------------------------------------- rules and rewards


def test_push_onto_last_target_wins():
    env = play(ONE_PUSH_TO_WIN)
    obs, reward, terminated, truncated, info = env.step(RIGHT)
    assert obs == "######\n#_P√_#\n######"
    assert reward == pytest.approx(-0.1 + 1 + 10)
    assert terminated and not truncated
    assert info == {"success": True, "action_is_valid": True, "action_is_effective": True}


def test_push_onto_one_of_two_targets():
    env = play(TWO_BOXES)
    _, reward, terminated, _, info = env.step(RIGHT)
    assert reward == pytest.approx(-0.1 + 1)
    assert not terminated and not info["success"]


def test_push_off_target_and_into_box():
    env = play(BOX_ON_TARGET_THEN_BOX)
    obs, reward, _, _, info = env.step(RIGHT)
    assert obs == "#######\n#_SXXO#\n#######"
    assert reward == pytest.approx(-0.1 - 1) and info["action_is_effective"]
    # The box now touches another box: pushing moves nothing.
    before = env.render()
    _, reward, _, _, info = env.step(RIGHT)
    assert env.render() == before
    assert reward == pytest.approx(-0.1) and not info["action_is_effective"]


def test_walk_into_wall_and_push_box_into_wall():
    env = play(BOX_AGAINST_WALL)
    before = env.render()
    for action in (UP, RIGHT):  # wall above; box against the wall on the right
        _, reward, terminated, truncated, info = env.step(action)
        assert env.render() == before
        assert reward == pytest.approx(-0.1)
        assert not (terminated or truncated)
        assert info == {"success": False, "action_is_valid": True, "action_is_effective": False}
    _, reward, _, _, info = env.step(LEFT)  # plain walk
    assert reward == pytest.approx(-0.1) and info["action_is_effective"]
    assert env.room.player == (1, 1)


def test_truncation_at_max_steps():
    env = play(BOX_AGAINST_WALL, max_steps=3)
    results = [env.step(UP) for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True]
    assert not any(r[2] for r in results)
    with pytest.raises(ValueError, match="episode is over; call reset"):
        env.step(UP)


def test_step_after_termination_raises():
    env = play(ONE_PUSH_TO_WIN)
    env.step(RIGHT)
    with pytest.raises(ValueError, match="episode is over"):
        env.step(LEFT)
    env.reset(seed=0)  # reset makes it playable again
    env.step(LEFT)


# ---------------------------------------------------------------- determinism and generation


def test_same_seed_same_room_and_trajectory():
    actions = [UP, LEFT, DOWN, RIGHT, RIGHT, UP, LEFT, DOWN] * 3

    def trajectory(seed):
        env = SokobanEnv()
        out = [env.reset(seed=seed)[0]]
        for action in actions:
            obs, reward, terminated, truncated, _ = env.step(action)
            out.append((obs, reward, terminated, truncated))
            if terminated or truncated:
                break
        return out

    assert trajectory(7) == trajectory(7)
    env = SokobanEnv()
    assert env.reset(seed=7)[0] == SokobanEnv().reset(seed=7)[0]
    assert env.reset(seed=7)[0] == trajectory(7)[0]  # reseeding an used env gives the same room


def test_different_seeds_differ():
    env = SokobanEnv()
    rooms = {env.reset(seed=seed)[0] for seed in range(20)}
    assert len(rooms) >= 15


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), preset=st.sampled_from([SIMPLE_SOKOBAN, LARGER_SOKOBAN]))
def test_generated_room_is_solvable_by_solver_plan(seed, preset):
    env = SokobanEnv(**preset)
    obs, info = env.reset(seed=seed)
    room = env.room
    assert not info["success"] and not (room.boxes & room.targets)  # every box starts off target
    assert len(room.boxes) == len(room.targets) == preset["num_boxes"]
    plan = solve(env)
    assert plan, "generated room must be solvable"
    for i, action in enumerate(plan):
        _, _, terminated, truncated, info = env.step(action)
        assert terminated == (i == len(plan) - 1)
    assert info["success"]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), actions=st.lists(st.integers(1, 4), max_size=60))
def test_random_play_keeps_invariants(seed, actions):
    env = SokobanEnv()
    env.reset(seed=seed)
    walls, targets, num_boxes = env.room.walls, env.room.targets, len(env.room.boxes)
    for action in actions:
        _, reward, terminated, truncated, info = env.step(action)
        room = env.room
        assert room.walls == walls and room.targets == targets
        assert len(room.boxes) == num_boxes and not (room.boxes & walls)
        assert room.player not in walls and room.player not in room.boxes
        state = env.room_state
        assert ((state == CODE_BOX) | (state == CODE_BOX_ON_TARGET)).sum() == num_boxes
        assert min(abs(reward - r) for r in (-0.1, 0.9, -1.1, 10.9)) < 1e-9
        assert info["success"] == terminated
        if terminated or truncated:
            break


# ---------------------------------------------------------------- solver


@pytest.mark.parametrize(
    "level, length",
    [(ONE_PUSH_TO_WIN, 1), (TWO_BOXES, 4), (AROUND_THE_CORNER, 6), ("#######\n#P_X_O#\n#######", 3)],
)
def test_solver_is_optimal_on_hand_made_levels(level, length):
    plan = solve(level)
    assert len(plan) == length
    env = play(level)
    for action in plan:
        _, _, terminated, _, info = env.step(action)
    assert terminated and info["success"]


def test_solver_reports_unsolvable():
    assert solve(BOX_IN_CORNER) is None


# ---------------------------------------------------------------- bad input


def test_bad_action_ids():
    env = play(BOX_AGAINST_WALL)
    for bad in (0, 5, -1, "Up", None):
        with pytest.raises(ValueError, match="action"):
            env.step(bad)


@pytest.mark.parametrize(
    "level, problem",
    [
        ("#####\n#PXY#\n#####", "unknown symbol 'Y'"),
        ("#####\n#_XO#\n#####", "exactly one player"),
        ("######\n#PXOP#\n######", "exactly one player"),
        ("######\n#PXXO#\n######", r"number of boxes \(2\) != number of targets \(1\)"),
        ("#####\n#PXO#\n####", "ragged rows"),
        ("#####\n#P_O#\n#####", "no boxes"),
        ("#####\n#P√_#\n#####", "already solved"),
        ("#####\n#PXO_\n#####", "enclosed by walls"),
        ("  \n", "non-empty text grid"),
    ],
)
def test_malformed_levels(level, problem):
    with pytest.raises(ValueError, match=problem):
        SokobanEnv().reset(options={"level": level})


@pytest.mark.parametrize(
    "cfg, problem",
    [
        (dict(dim_room=(2, 2)), "at least 3x3"),
        (dict(num_boxes=50), "num_boxes"),
        (dict(num_boxes=0), "num_boxes"),
        (dict(observation_format="rgb"), "observation_format"),
        (dict(max_steps=0), "max_steps must be positive"),
        (dict(dim_room=(6, 6, 6)), "two ints"),
        (dict(colour="red"), "unknown config key 'colour'"),
        (dict(num_boxes=1.5), "must be an int"),
    ],
)
def test_impossible_configs(cfg, problem):
    with pytest.raises(ValueError, match=problem):
        SokobanEnv(**cfg)


def test_generation_gives_up_after_max_tries():
    # A 1x2 interior is a corridor: the box can never be pulled off its target.
    env = SokobanEnv(dim_room=(3, 4), max_generation_tries=3)
    with pytest.raises(ValueError, match="could not generate .* in 3 tries"):
        env.reset(seed=0)


def test_level_larger_than_dim_room_fits_observation_space():
    env = SokobanEnv(dim_room=(3, 4), observation_format="grid_coord")
    level = "\n".join(["#" * 12] + ["#PXO" + "_" * 7 + "#"] + ["#" + "_" * 10 + "#"] * 8 + ["#" * 12])
    assert parse_level(level).shape == (11, 12)
    configured_max = env.observation_space.max_length
    obs, _ = env.reset(options={"level": level})
    assert len(obs) > configured_max and obs in env.observation_space
