"""Optimal Sokoban solver: breadth-first search over ``(player, boxes)`` states.

Every move costs the same (-0.1 reward per step), so the search counts player moves, not
pushes, and the first solution found is a shortest action list. Pushes onto *dead* cells,
from which no box can ever reach a target, are pruned; that never removes a solution.
"""

from __future__ import annotations

from typing import Any

from ragen.envs.sokoban.room import MOVES, Room, parse_level

#: Default bound on visited states (a few hundred MB at most); beyond it ``solve`` gives up.
MAX_STATES = 1_000_000


def solve(problem: Any, max_states: int = MAX_STATES) -> list[int] | None:
    """A shortest list of action ids solving ``problem``, or None if there is none within ``max_states`` states.

    ``problem`` is a :class:`Room`, a level text grid, or anything with a ``room`` attribute
    (such as a reset ``SokobanEnv``, solved from its current position).
    """
    room = _as_room(problem)
    width = room.shape[1]
    walls = frozenset(r * width + c for r, c in room.walls)
    targets = frozenset(r * width + c for r, c in room.targets)
    live = _live_cells(walls, targets, width)
    offsets = {action: d_row * width + d_col for action, (d_row, d_col) in MOVES.items()}
    start = (room.player[0] * width + room.player[1], frozenset(r * width + c for r, c in room.boxes))
    if start[1] == targets:
        return []
    parents: dict[tuple, tuple | None] = {start: None}
    frontier = [start]
    while frontier and len(parents) < max_states:
        next_frontier = []
        for state in frontier:
            player, boxes = state
            for action, offset in offsets.items():
                dest = player + offset
                if dest in walls:
                    continue
                if dest in boxes:
                    beyond = dest + offset
                    if beyond not in live or beyond in boxes:
                        continue
                    new_state = (dest, boxes - {dest} | {beyond})
                else:
                    new_state = (dest, boxes)
                if new_state in parents:
                    continue
                parents[new_state] = (state, action)
                if new_state[1] == targets:
                    return _actions_to(new_state, parents)
                next_frontier.append(new_state)
        frontier = next_frontier
    return None


def _as_room(problem: Any) -> Room:
    if isinstance(problem, Room):
        return problem
    if isinstance(problem, str):
        return parse_level(problem)
    room = getattr(problem, "room", None)
    if not isinstance(room, Room):
        raise ValueError(f"solve: expected a Room, a level string or a reset SokobanEnv, got {problem!r}")
    return room


def _live_cells(walls: frozenset[int], targets: frozenset[int], width: int) -> set[int]:
    """Cells from which a lone box can be pushed to some target (pull the box back from every target)."""
    live = set(targets)
    stack = list(targets)
    while stack:
        box = stack.pop()
        for offset in (-width, width, -1, 1):
            before, player = box - offset, box - 2 * offset
            if before not in live and before not in walls and player not in walls:
                live.add(before)
                stack.append(before)
    return live


def _actions_to(state: tuple, parents: dict[tuple, tuple | None]) -> list[int]:
    actions = []
    while parents[state] is not None:
        state, action = parents[state]
        actions.append(action)
    return actions[::-1]
