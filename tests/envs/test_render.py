"""``render_mode="rgb_array"`` for Sokoban and FrozenLake, and the numpy tile / PNG helpers."""

from __future__ import annotations

import io
import itertools
import warnings

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import ragen.envs
from ragen.envs.frozen_lake import TILES as LAKE_TILES
from ragen.envs.frozen_lake import FrozenLakeEnv
from ragen.envs.render import TILE_SIZE, Glyph, Tile, draw_grid, encode_png, tile_image
from ragen.envs.sokoban import SokobanEnv
from ragen.envs.sokoban.env import TILES as SOKOBAN_TILES

UP, DOWN, LEFT, RIGHT = 1, 2, 3, 4  # Sokoban ids
LAKE_LEFT, LAKE_DOWN, LAKE_RIGHT, LAKE_UP = 1, 2, 3, 4
ROOM = "#####\n#P__#\n#_X_#\n#_O_#\n#####"


def strict_check_env(env):
    """gymnasium's checker, failing on any of its warnings but the one about envs without a gymnasium spec."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    problems = [str(w.message) for w in caught if "not having a spec" not in str(w.message)]
    assert not problems, problems


@pytest.mark.parametrize("name", ["sokoban", "frozen_lake"])
@pytest.mark.parametrize("mode", [None, "text", "ansi", "rgb_array"])
def test_check_env_in_every_render_mode(name, mode):
    env = ragen.envs.make(name, render_mode=mode)
    assert mode is None or mode in env.metadata["render_modes"]
    assert env.metadata["render_fps"] > 0
    strict_check_env(env)


def test_only_rgb_grid_envs_declare_rgb_array():
    with_rgb = {n for n, cls in ragen.envs.registered().items() if "rgb_array" in cls.metadata.get("render_modes", ())}
    assert with_rgb == {"sokoban", "frozen_lake"}


@pytest.mark.parametrize("name", ["sokoban", "frozen_lake"])
def test_unknown_render_mode_and_bad_tile_size_are_rejected(name):
    with pytest.raises(ValueError, match="render_mode 'human'"):
        ragen.envs.make(name, render_mode="human")
    with pytest.raises(ValueError, match="tile_size"):
        ragen.envs.make(name, render_mode="rgb_array", tile_size=0)


@pytest.mark.parametrize("name", ["sokoban", "frozen_lake"])
@pytest.mark.parametrize("mode", ["text", "ansi"])
def test_text_render_is_unchanged(name, mode):
    plain, textual = ragen.envs.make(name), ragen.envs.make(name, render_mode=mode)
    assert plain.render() == textual.render() == ""  # before reset
    obs, _ = plain.reset(seed=11)
    assert textual.reset(seed=11)[0] == obs == plain.render() == textual.render()
    obs, *_ = plain.step(2)
    assert textual.step(2)[0] == obs == plain.render() == textual.render()


@pytest.mark.parametrize("name", ["sokoban", "frozen_lake"])
def test_observations_stay_text_in_rgb_array_mode(name):
    plain, rgb = ragen.envs.make(name), ragen.envs.make(name, render_mode="rgb_array")
    assert rgb.render().shape == (0, 0, 3)  # before reset
    assert rgb.reset(seed=4)[0] == plain.reset(seed=4)[0]
    assert rgb.step(3)[0] == plain.step(3)[0]


def test_sokoban_frame_shape_dtype_and_tiles():
    env = SokobanEnv(render_mode="rgb_array", dim_room=(7, 5))
    env.reset(seed=0)
    frame = env.render()
    assert frame.shape == (7 * TILE_SIZE, 5 * TILE_SIZE, 3) and frame.dtype == np.uint8
    small = SokobanEnv(render_mode="rgb_array", tile_size=8)
    small.reset(options={"level": ROOM})
    frame = small.render()
    assert frame.shape == (5 * 8, 5 * 8, 3)
    # Each cell is exactly its symbol's tile.
    for r, row in enumerate(ROOM.split("\n")):
        for c, symbol in enumerate(row):
            assert np.array_equal(frame[r * 8:(r + 1) * 8, c * 8:(c + 1) * 8], tile_image(SOKOBAN_TILES[symbol], 8))


def test_frozen_lake_frame_shape():
    env = FrozenLakeEnv(render_mode="rgb_array", size=5)
    env.reset(seed=0)
    assert env.render().shape == (5 * TILE_SIZE, 5 * TILE_SIZE, 3)
    env.reset(seed=0, options={"map": ["SFH", "FFG"]})
    assert env.render().shape == (2 * TILE_SIZE, 3 * TILE_SIZE, 3)


@pytest.mark.parametrize("tiles", [SOKOBAN_TILES, LAKE_TILES], ids=["sokoban", "frozen_lake"])
def test_every_symbol_has_a_distinct_tile(tiles):
    for a, b in itertools.combinations(tiles, 2):
        assert not np.array_equal(tile_image(tiles[a], 16), tile_image(tiles[b], 16)), (a, b)


def test_sokoban_frame_changes_when_the_player_moves_and_only_then():
    env = SokobanEnv(render_mode="rgb_array", tile_size=8)
    env.reset(options={"level": ROOM})
    start = env.render()
    env.step(UP)  # into the wall: nothing moves
    assert np.array_equal(env.render(), start)
    _, _, _, _, info = env.step(RIGHT)
    assert info["action_is_effective"]
    moved = env.render()
    assert not np.array_equal(moved, start)
    changed = np.argwhere((moved != start).any(axis=2))
    # Only the two cells the player left and entered changed: (1, 1) and (1, 2).
    assert {(int(r) // 8, int(c) // 8) for r, c in changed} == {(1, 1), (1, 2)}
    env.step(DOWN)  # push the box onto the target
    assert np.array_equal(env.render()[3 * 8:4 * 8, 2 * 8:3 * 8], tile_image(SOKOBAN_TILES["√"], 8))


def test_frozen_lake_frame_changes_when_the_player_moves():
    env = FrozenLakeEnv(render_mode="rgb_array", is_slippery=False, tile_size=8)
    env.reset(seed=0, options={"map": ["SFH", "FFF", "FFG"]})
    start = env.render()
    env.step(LAKE_LEFT)  # against the border
    assert np.array_equal(env.render(), start)
    env.step(LAKE_RIGHT)
    moved = env.render()
    assert not np.array_equal(moved, start)
    env.step(LAKE_RIGHT)  # into the hole
    assert np.array_equal(env.render()[0:8, 16:24], tile_image(LAKE_TILES["X"], 8))


@pytest.mark.parametrize("name,cfg", [("sokoban", {}), ("sokoban", {"dim_room": (8, 8), "num_boxes": 2}),
                                      ("frozen_lake", {}), ("frozen_lake", {"size": 6})])
def test_frames_are_deterministic_for_a_seed(name, cfg):
    def frames(seed):
        env = ragen.envs.make(name, render_mode="rgb_array", **cfg)
        env.reset(seed=seed)
        out = [env.render()]
        for action in (2, 3, 4, 1, 2):
            _, _, terminated, truncated, _ = env.step(action)
            out.append(env.render())
            if terminated or truncated:
                break
        return out

    first, again, other = frames(5), frames(5), frames(6)
    assert len(first) == len(again) and all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[0], other[0])


def test_slippery_frozen_lake_frames_repeat_under_the_same_seed():
    def run():
        env = FrozenLakeEnv(render_mode="rgb_array", size=5, is_slippery=True)
        env.reset(seed=21)
        out = []
        for _ in range(8):
            _, _, terminated, truncated, _ = env.step(LAKE_DOWN)
            out.append(env.render())
            if terminated or truncated:
                break
        return out

    a, b = run(), run()
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_draw_grid_checks_its_input():
    with pytest.raises(ValueError, match="ragged"):
        draw_grid(["#_", "#"], SOKOBAN_TILES)
    with pytest.raises(ValueError, match="no tile for symbol 'Q'"):
        draw_grid(["#Q"], SOKOBAN_TILES)
    with pytest.raises(ValueError, match="unknown glyph shape"):
        tile_image(Tile((0, 0, 0), (Glyph("star", (1, 2, 3)),)), 7)
    assert draw_grid([], SOKOBAN_TILES).shape == (0, 0, 3)


def test_encode_png_round_trips():
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, size=(13, 21, 3), dtype=np.uint8)
    data = encode_png(frame)
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(b"IEND\xaeB`\x82")
    assert encode_png(frame) == data  # deterministic bytes
    Image = pytest.importorskip("PIL.Image")
    with Image.open(io.BytesIO(data)) as img:
        assert img.mode == "RGB" and img.size == (21, 13)
        assert np.array_equal(np.asarray(img), frame)
    with pytest.raises(ValueError):
        encode_png(frame.astype(np.float32))
    with pytest.raises(ValueError):
        encode_png(np.zeros((0, 0, 3), dtype=np.uint8))
