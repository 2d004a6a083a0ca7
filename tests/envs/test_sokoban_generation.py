"""Sokoban generation: hopeless tries are dropped before the reverse-play search, and rooms stay the same.

``(32, 32)`` with 8 boxes used to run the reverse-play search (up to 100000 states, ~0.5 s each) in all 50 tries
and give up after ~23-30 s. Most tries cannot pull every box off its target within ``search_depth`` moves at all
(``min_pull_moves``); those are now dropped without the search. The search draws nothing from ``np_random``, so
the rooms generated are unchanged: the golden rooms below were rendered by the code before the change.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gymnasium.utils import seeding

import ragen.envs.sokoban.generation as generation
from ragen.envs.sokoban.env import SokobanEnv

#: (dim_room, num_boxes, search_depth, seed, the grid ``reset(seed=seed)`` returned before the change).
SMALL = [
    ((6, 6), 1, 30, 0, "\n".join([
        "######",
        "######",
        "###P_#",
        "##_X_#",
        "##O__#",
        "######",
    ])),
    ((6, 6), 1, 30, 7, "\n".join([
        "######",
        "##__O#",
        "##___#",
        "#PX__#",
        "#____#",
        "######",
    ])),
    ((6, 6), 1, 30, 42, "\n".join([
        "######",
        "#O_XP#",
        "#____#",
        "######",
        "######",
        "######",
    ])),
    ((8, 8), 2, 30, 0, "\n".join([
        "########",
        "#______#",
        "#PX____#",
        "#O____##",
        "###____#",
        "####XO_#",
        "####___#",
        "########",
    ])),
    ((8, 8), 2, 30, 49, "\n".join([
        "########",
        "#____P_#",
        "#O__XX_#",
        "#####_O#",
        "#####__#",
        "######_#",
        "########",
        "########",
    ])),
    ((8, 8), 2, 10, 5, "\n".join([
        "########",
        "#PX_O__#",
        "#___X_O#",
        "#####__#",
        "#####__#",
        "#####__#",
        "######_#",
        "########",
    ])),
    ((10, 10), 3, 30, 2, "\n".join([
        "##########",
        "####___P_#",
        "#####__X_#",
        "####OO___#",
        "#####_XX_#",
        "#######O_#",
        "########_#",
        "##########",
        "##########",
        "##########",
    ])),
]
#: The same for bigger rooms, as the SHA-256 of the grid text.
BIG = [
    ((32, 32), 4, 30, 0, "b35a7f9343032db4b009bd5d2caa6b01152440e7f290915de1e1f55471d02cd8"),
    ((16, 16), 8, 30, 1, "a950aa738680d09eebd2076996add45fffbddab93b04289c0d1eb88362ed183c"),
    ((32, 32), 2, 30, 3, "88823c1e1a7032a01f2b86e68e2ac47e24d5320cc3a52172686de98a1eee56d7"),
]


@pytest.mark.parametrize("dim_room, num_boxes, search_depth, seed, grid", SMALL)
def test_small_rooms_are_unchanged(dim_room, num_boxes, search_depth, seed, grid):
    env = SokobanEnv(dim_room=dim_room, num_boxes=num_boxes, search_depth=search_depth)
    assert env.reset(seed=seed)[0] == grid


@pytest.mark.parametrize("dim_room, num_boxes, search_depth, seed, digest", BIG)
def test_big_rooms_are_unchanged(dim_room, num_boxes, search_depth, seed, digest):
    env = SokobanEnv(dim_room=dim_room, num_boxes=num_boxes, search_depth=search_depth)
    assert hashlib.sha256(env.reset(seed=seed)[0].encode()).hexdigest() == digest


def _count_searches(monkeypatch) -> list:
    """Replace the reverse-play search by one that finds nothing, and record its calls."""
    calls = []
    monkeypatch.setattr(generation, "reverse_play", lambda *args: calls.append(args))
    return calls


def test_hopeless_tries_skip_the_search(monkeypatch):
    """32x32 with 8 boxes: the old code searched in all 50 tries; 43 of them cannot pull every box off."""
    calls = _count_searches(monkeypatch)
    with pytest.raises(ValueError, match=r"in 50 tries \(in 43 of them the boxes could not all be pulled off") as err:
        SokobanEnv(dim_room=(32, 32), num_boxes=8).reset(seed=0)
    assert len(calls) == 7
    for name in ("num_boxes=8", "search_depth", "dim_room", "max_generation_tries"):
        assert name in str(err.value)


def test_more_boxes_than_search_depth_never_searches(monkeypatch):
    """Each box needs a pull of its own: 8 boxes cannot all move in 5 reverse moves."""
    calls = _count_searches(monkeypatch)
    with pytest.raises(ValueError, match=r"in \d+ of them .* search_depth=5 moves\); use fewer boxes \(num_boxes=8\)"):
        SokobanEnv(dim_room=(10, 10), num_boxes=8, search_depth=5).reset(seed=0)
    assert calls == []


def test_failed_reset_draws_as_before():
    """Dropped tries still make their draws: after a failed reset, np_random is where the old code left it."""
    env = SokobanEnv(dim_room=(32, 32), num_boxes=8)
    with pytest.raises(ValueError):
        env.reset(seed=0)
    rng, _ = seeding.np_random(0)
    for _ in range(50):  # each try: a floor carve, then the player and targets
        floor = generation.carve_floor(rng, (32, 32), int(1.7 * 64))
        if len(floor) > 8:
            rng.choice(len(floor), size=9, replace=False)
    assert env.np_random.bit_generator.state == rng.bit_generator.state


@pytest.mark.parametrize("dim_room, num_boxes", [((6, 6), 1), ((6, 6), 3), ((7, 7), 2), ((8, 8), 4), ((5, 5), 2)])
def test_the_bound_never_drops_a_try_the_search_would_keep(dim_room, num_boxes):
    """``min_pull_moves`` is a lower bound: above ``search_depth`` the search finds nothing."""
    rng = np.random.default_rng(num_boxes)
    height, width = dim_room
    dropped = 0
    for _ in range(150):
        floor = generation.carve_floor(rng, dim_room, int(1.7 * (height + width)))
        if len(floor) <= num_boxes:
            continue
        picks = rng.choice(len(floor), size=num_boxes + 1, replace=False).tolist()
        player, targets = floor[picks[0]], [floor[i] for i in picks[1:]]
        for depth in (4, 10, 30):
            if generation.min_pull_moves(set(floor), player, targets, width, depth) > depth:
                dropped += 1
                assert generation.reverse_play(set(floor), player, targets, width, depth) is None
    assert dropped > 0
