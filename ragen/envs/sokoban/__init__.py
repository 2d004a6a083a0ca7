"""Sokoban: the env (registered as ``"sokoban"``), its room generator and an optimal solver."""

from ragen.envs.sokoban.env import LARGER_SOKOBAN, SIMPLE_SOKOBAN, SokobanEnv
from ragen.envs.sokoban.generation import generate_room
from ragen.envs.sokoban.room import Room, parse_level, render_coords, render_grid
from ragen.envs.sokoban.solver import solve

__all__ = [
    "SokobanEnv",
    "SIMPLE_SOKOBAN",
    "LARGER_SOKOBAN",
    "Room",
    "generate_room",
    "parse_level",
    "render_grid",
    "render_coords",
    "solve",
]
