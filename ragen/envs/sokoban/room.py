"""A Sokoban position as plain data, plus its text forms (RAGEN grid symbols and coordinate lists).

Cells are ``(row, col)`` tuples, row 0 at the top. Every room is enclosed by walls, so a
player or box inside the room never has a neighbour outside the grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Cell = tuple[int, int]

WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = "#", "_", "O", "√", "X", "P", "S"
GRID_SYMBOLS = WALL + FLOOR + TARGET + BOX_ON_TARGET + BOX + PLAYER + PLAYER_ON_TARGET
SYMBOL_LEGEND = (
    f"{WALL}: wall, {FLOOR}: empty floor, {TARGET}: target, {BOX_ON_TARGET}: box on target, "
    f"{BOX}: box, {PLAYER}: player, {PLAYER_ON_TARGET}: player on target"
)
#: Section names of the coordinate format, in the order they are printed.
COORD_SECTIONS = ("walls", "targets", "boxes", "player")

#: Action id -> (row, col) step, matching ``SokobanEnv.action_lookup``.
MOVES: dict[int, Cell] = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}

# gym-sokoban's integer codes, for ``room_fixed`` / ``room_state`` arrays.
CODE_WALL, CODE_FLOOR, CODE_TARGET, CODE_BOX_ON_TARGET, CODE_BOX, CODE_PLAYER = range(6)


@dataclass(frozen=True)
class Room:
    """An immutable Sokoban position: static layout (walls, targets) plus movable pieces."""

    shape: tuple[int, int]
    walls: frozenset[Cell]
    targets: frozenset[Cell]
    boxes: frozenset[Cell]
    player: Cell

    @property
    def solved(self) -> bool:
        return self.boxes == self.targets

    def room_fixed(self) -> np.ndarray:
        """gym-sokoban's static grid: 0 wall, 1 floor, 2 target."""
        grid = np.full(self.shape, CODE_FLOOR, dtype=np.int8)
        for cell in self.walls:
            grid[cell] = CODE_WALL
        for cell in self.targets:
            grid[cell] = CODE_TARGET
        return grid

    def room_state(self) -> np.ndarray:
        """gym-sokoban's full grid: room_fixed plus 3 box on target, 4 box, 5 player."""
        grid = self.room_fixed()
        for cell in self.boxes:
            grid[cell] = CODE_BOX_ON_TARGET if cell in self.targets else CODE_BOX
        grid[self.player] = CODE_PLAYER
        return grid


def render_grid(room: Room) -> str:
    """The room as RAGEN's text grid, rows joined by newlines."""
    rows = []
    for r in range(room.shape[0]):
        rows.append("".join(_symbol(room, (r, c)) for c in range(room.shape[1])))
    return "\n".join(rows)


def _symbol(room: Room, cell: Cell) -> str:
    on_target = cell in room.targets
    if cell in room.walls:
        return WALL
    if cell == room.player:
        return PLAYER_ON_TARGET if on_target else PLAYER
    if cell in room.boxes:
        return BOX_ON_TARGET if on_target else BOX
    return TARGET if on_target else FLOOR


def render_coords(room: Room) -> str:
    """The room as one line per section, e.g. ``boxes: (2, 3), (3, 3)``."""
    sections = {"walls": room.walls, "targets": room.targets, "boxes": room.boxes, "player": [room.player]}
    lines = [f"{name}: " + ", ".join(f"({r}, {c})" for r, c in sorted(sections[name])) for name in COORD_SECTIONS]
    return "\n".join(lines)


def parse_level(text: str) -> Room:
    """Read a RAGEN text grid; raise ``ValueError`` naming the problem if it is not a playable level."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"sokoban level: must be a non-empty text grid, got {text!r}")
    rows = [line.strip() for line in text.strip().splitlines()]
    if any(len(row) != len(rows[0]) for row in rows):
        lengths = [len(row) for row in rows]
        raise ValueError(f"sokoban level: ragged rows (lengths {lengths}); all rows need the same length")
    cells: dict[str, list[Cell]] = {symbol: [] for symbol in GRID_SYMBOLS}
    for r, row in enumerate(rows):
        for c, symbol in enumerate(row):
            if symbol not in cells:
                raise ValueError(
                    f"sokoban level: unknown symbol {symbol!r} at ({r}, {c}); expected one of {GRID_SYMBOLS!r}"
                )
            cells[symbol].append((r, c))
    players = cells[PLAYER] + cells[PLAYER_ON_TARGET]
    if len(players) != 1:
        raise ValueError(
            f"sokoban level: needs exactly one player ('{PLAYER}' or '{PLAYER_ON_TARGET}'), found {len(players)}"
        )
    room = Room(
        shape=(len(rows), len(rows[0])),
        walls=frozenset(cells[WALL]),
        targets=frozenset(cells[TARGET] + cells[BOX_ON_TARGET] + cells[PLAYER_ON_TARGET]),
        boxes=frozenset(cells[BOX] + cells[BOX_ON_TARGET]),
        player=players[0],
    )
    _check_playable(room)
    return room


def _check_playable(room: Room) -> None:
    if not room.boxes:
        raise ValueError("sokoban level: has no boxes")
    if len(room.boxes) != len(room.targets):
        raise ValueError(
            f"sokoban level: number of boxes ({len(room.boxes)}) != number of targets ({len(room.targets)})"
        )
    if room.solved:
        raise ValueError("sokoban level: already solved (every box is on a target)")
    height, width = room.shape
    for r in range(height):
        for c in range(width):
            if (r in (0, height - 1) or c in (0, width - 1)) and (r, c) not in room.walls:
                raise ValueError(f"sokoban level: must be enclosed by walls; border cell ({r}, {c}) is not a wall")


def apply_move(room: Room, action: int) -> Room:
    """The room after the player tries to move one cell; returns ``room`` itself if nothing moves.

    Moving into a box pushes it when the cell beyond is floor or an empty target.
    """
    dr, dc = MOVES[action]
    row, col = room.player
    dest = (row + dr, col + dc)
    if dest in room.walls:
        return room
    if dest not in room.boxes:
        return Room(room.shape, room.walls, room.targets, room.boxes, dest)
    beyond = (row + 2 * dr, col + 2 * dc)
    if beyond in room.walls or beyond in room.boxes:
        return room
    return Room(room.shape, room.walls, room.targets, room.boxes - {dest} | {beyond}, dest)
