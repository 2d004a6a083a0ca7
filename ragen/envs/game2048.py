"""2048: slide numbered tiles on a grid, merging equal ones, until a target tile appears."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from gymnasium import spaces

from ragen.envs.base import TextEnv, after_start_rng, build_config
from ragen.envs.registry import register
from ragen.envs.render import check_render_mode

ACTION_LOOKUP = {1: "Up", 2: "Down", 3: "Left", 4: "Right"}
UP, DOWN, LEFT, RIGHT = 1, 2, 3, 4

_CHARSET = frozenset("0123456789. \n")
#: The largest ``target``: the board holds 64-bit ints, and no tile exceeds the target.
MAX_TARGET = 2**62
#: The largest ``size``. The expert (:func:`best_move`) looks at every empty cell after every move, about size^4 work:
#: measured on 2 CPU cores, 5 ms a move at 4x4, 32 ms at 8x8 and 0.3 s at 16x16 (minutes per won game, which takes
#: about a thousand moves); its snake weights 4**-k also underflow to 0 beyond 23x23. A bigger value is far more
#: likely a typo than a wish: ``size=10**6`` made ``reset`` try to allocate a 7 TiB board.
MAX_SIZE = 16


@register("game2048")
class Game2048Env(TextEnv):
    """The 2048 sliding-tile game (Gabriele Cirulli's rules) on a ``size`` x ``size`` grid.

    ## Description
    Every move slides all tiles as far as they go in one direction; two equal tiles that
    meet merge into one of twice the value, and a tile made by a merge does not merge again
    in the same move. Merges are taken from the side the tiles move towards: a row
    ``2 2 2 2`` moved Left gives ``4 4 . .``, ``2 2 4 .`` gives ``4 4 . .`` (not ``8``), and
    ``2 2 2 .`` gives ``4 2 . .`` Left but ``. . 2 4`` Right. After a move that changed the
    board a new tile, 4 with probability ``spawn_four_prob`` and 2 otherwise, appears on an
    empty cell chosen uniformly; a move that changes nothing spawns nothing. The game starts
    with two spawned tiles. ``reset(options={"board": ROWS})`` plays a given board instead
    (``size`` rows of ``size`` ints, 0 = empty, every tile a power of two below ``target``,
    at least one possible move).

    ## Action Space
    ``Discrete(4, start=1)``: 1 Up, 2 Down, 3 Left, 4 Right (the default ``parse_action``
    matches the names, case-insensitively).

    ## Observation Space
    ``Text``: one line per row, each cell right-aligned to the width of the largest tile,
    ``.`` for an empty cell, cells separated by a space.

    ## Starting State
    An empty board with two spawned tiles (same seed, same board). The tiles spawned after
    moves come from the same seeded generator, or with ``own_spawn_draw`` from one seeded by the
    seed and ``reset(options={"group_member": j})``: the envs of a group (one seed, so one
    start board) each meet their own spawns, still reproducibly
    (:func:`ragen.envs.base.after_start_rng`).

    ## Rewards
    The sum of the tiles created by merges in the move (the standard 2048 score increment):
    merging two 8s earns 16. Moves without a merge, and moves that change nothing, earn 0.

    ## Episode End
    Terminated when a tile reaches ``target`` (``success``) or no move can change the board
    (the board is full and no two neighbours are equal); truncated after ``max_steps`` steps
    (ineffective moves count). Stepping after either raises ``ValueError``.

    ## Information
    ``success`` (a tile reached ``target``), ``action_is_valid`` (always True: invalid ids
    raise), ``action_is_effective`` (the move changed the board), ``spawned`` (``(row, col,
    value)`` of the new tile, 0-based, or None), ``score`` (rewards so far), ``max_tile``.

    ## Arguments
    ``size`` (2..16, :data:`MAX_SIZE`), ``target`` (a power of two in 8..2**62, or 4 with ``spawn_four_prob`` 0),
    ``max_steps``, ``spawn_four_prob`` (in [0, 1]), ``own_spawn_draw`` (False: a group's envs share the spawns,
    as they share the seed).

    See :func:`move` (one move on a board, pure) and :func:`best_move` (the expert's
    heuristic: a two-move lookahead with the corner strategy).
    """

    description = "2048: slide and merge equal tiles (Up/Down/Left/Right) until a tile reaches the target (2048)."
    action_lookup = dict(ACTION_LOOKUP)
    action_space = spaces.Discrete(4, start=1)
    metadata = {"render_modes": ["text", "ansi"], "render_fps": 4}

    @dataclass
    class Config:
        size: int = 4
        target: int = 2048
        max_steps: int = 2000
        spawn_four_prob: float = 0.1
        own_spawn_draw: bool = False

        def validate(self) -> None:
            if not 2 <= self.size <= MAX_SIZE:
                raise ValueError(f"game2048: size must be in 2..{MAX_SIZE}, got {self.size}")
            if self.target < 4 or self.target & (self.target - 1):
                raise ValueError(f"game2048: target must be a power of two >= 4, got {self.target}")
            if self.target > MAX_TARGET:
                raise ValueError(f"game2048: target must be at most 2**62 (tiles are 64-bit ints), got {self.target}")
            if self.target == 4 and self.spawn_four_prob > 0:
                # a spawned 4 would be the target: the start board could already be won
                raise ValueError("game2048: target 4 needs spawn_four_prob=0 (a spawned 4 is the target); "
                                 f"got spawn_four_prob={self.spawn_four_prob}")
            if self.max_steps <= 0:
                raise ValueError(f"game2048: max_steps must be positive, got {self.max_steps}")
            if not 0.0 <= self.spawn_four_prob <= 1.0:
                raise ValueError(f"game2048: spawn_four_prob must be in [0, 1], got {self.spawn_four_prob}")

    def __init__(self, render_mode: str | None = None, **cfg: Any):
        self.config = build_config(self.Config, cfg, "game2048")
        self.render_mode = check_render_mode("game2048", render_mode, self.metadata["render_modes"])
        c = self.config
        # No tile can exceed the target: two target tiles never coexist, the game ends at the first.
        width = len(str(c.target))
        self.observation_space = spaces.Text(min_length=1, max_length=c.size * c.size * (width + 1), charset=_CHARSET)
        if c.spawn_four_prob in (0.0, 1.0):
            new_tile = "a 4" if c.spawn_four_prob else "a 2"
        else:
            new_tile = f"a 2 (or a 4, with probability {c.spawn_four_prob:g})"
        self.instructions = (
            f"You are playing 2048 on a {c.size}x{c.size} grid. Each move slides every tile as far as possible "
            "in one direction: Up, Down, Left or Right. When two tiles with the same number collide they merge "
            "into one tile with their sum, and a merged tile does not merge again in the same move. Your reward "
            f"for a move is the sum of the merged tiles it creates. After every move that changes the board "
            f"{new_tile} appears on a random empty cell; a move that changes nothing is wasted. "
            f"Reach a {c.target} tile to win; the game is lost when the board is full and no move can merge tiles. "
            "In the state, each line is a row of the grid and . is an empty cell.\n"
            "Valid actions: " + ", ".join(ACTION_LOOKUP.values())
        )
        self.board: np.ndarray | None = None
        self.score = 0
        self._spawn_rng: np.random.Generator | None = None
        self.num_steps = 0
        self._done = True

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start on two spawned tiles, or on ``options["board"]`` (size x size ints, 0 = empty)."""
        super().reset(seed=seed)
        given = (options or {}).get("board")
        c = self.config
        if given is None:
            self.board = np.zeros((c.size, c.size), dtype=np.int64)
            self._spawn()
            self._spawn()
        else:
            self.board = _parse_board(given, c.size, c.target)
        self._spawn_rng = after_start_rng(self, seed, options, c.own_spawn_draw, "game2048")
        self.score = 0
        self.num_steps = 0
        self._done = False
        return self.render_text(), {"success": False, "score": 0, "max_tile": int(self.board.max())}

    def step(self, action):
        action = self.check_action(action)
        if self._done:
            raise ValueError("game2048: episode is over; call reset()")
        board, reward, effective = move(self.board, action)
        spawned = None
        if effective:
            self.board = board
            spawned = self._spawn(self._spawn_rng)
        self.num_steps += 1
        self.score += reward
        max_tile = int(self.board.max())
        success = max_tile >= self.config.target
        terminated = success or not can_move(self.board)
        truncated = not terminated and self.num_steps >= self.config.max_steps
        self._done = terminated or truncated
        info = {
            "success": success,
            "action_is_valid": True,
            "action_is_effective": effective,
            "spawned": spawned,
            "score": self.score,
            "max_tile": max_tile,
        }
        return self.render_text(), float(reward), terminated, truncated, info

    def render(self) -> str:
        """The observation text (every render mode is text)."""
        return self.render_text()

    def render_text(self) -> str:
        if self.board is None:
            return ""
        return render_board(self.board)

    def _spawn(self, rng: np.random.Generator | None = None) -> tuple[int, int, int]:
        """Put a 2 or 4 on a uniformly chosen empty cell (drawn from ``rng``, by default ``np_random``); return
        ``(row, col, value)``."""
        rng = self.np_random if rng is None else rng
        empty = np.flatnonzero(self.board == 0)
        cell = int(empty[rng.integers(len(empty))])
        value = 4 if rng.random() < self.config.spawn_four_prob else 2
        r, col = divmod(cell, self.config.size)
        self.board[r, col] = value
        return r, col, value


def slide_row(row: Any) -> tuple[list[int], int]:
    """Slide one line towards its start, merging equal neighbours once, from the start on.

    Returns the new line and the sum of the merged tiles: ``[2, 2, 2, 2] -> ([4, 4, 0, 0], 8)``,
    ``[2, 2, 4, 0] -> ([4, 4, 0, 0], 4)``.
    """
    tiles = [int(v) for v in row if v]
    out: list[int] = []
    score = 0
    i = 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            out.append(2 * tiles[i])
            score += 2 * tiles[i]
            i += 2
        else:
            out.append(tiles[i])
            i += 1
    return out + [0] * (len(row) - len(out)), score


def _to_left(board: np.ndarray, action: int) -> np.ndarray:
    """A view of ``board`` whose rows run in the direction of ``action`` (so the move is a Left move)."""
    if action == LEFT:
        return board
    if action == RIGHT:
        return board[:, ::-1]
    if action == UP:
        return board.T
    if action == DOWN:
        return board.T[:, ::-1]
    raise ValueError(f"game2048: unknown action {action!r}; use 1 Up, 2 Down, 3 Left, 4 Right")


def _from_left(lines: np.ndarray, action: int) -> np.ndarray:
    """Inverse of :func:`_to_left`."""
    if action == LEFT:
        return lines
    if action == RIGHT:
        return lines[:, ::-1]
    if action == UP:
        return lines.T
    return lines[:, ::-1].T  # DOWN


def move(board: Any, action: int) -> tuple[np.ndarray, int, bool]:
    """Apply one move (action id 1 Up, 2 Down, 3 Left, 4 Right) to ``board``, without spawning.

    Returns ``(new_board, merged, changed)``: a new array (``board`` is not modified), the
    sum of the merged tiles (the reward), and whether anything moved.
    """
    board = np.asarray(board, dtype=np.int64)
    slid, total = [], 0
    for line in _to_left(board, action):
        new, score = slide_row(line)
        slid.append(new)
        total += score
    new_board = np.ascontiguousarray(_from_left(np.array(slid, dtype=np.int64).reshape(board.shape), action))
    return new_board, total, bool((new_board != board).any())


def can_move(board: Any) -> bool:
    """Whether some move changes ``board``: an empty cell and a tile, or two equal (non-empty) neighbours.

    (A line holding a tile and an empty cell changes under Left or Right, or, if every row is
    full or empty, some column does under Up or Down; an all-empty board has no move.)
    """
    board = np.asarray(board)
    empty = board == 0
    if empty.all():
        return False
    if empty.any():
        return True
    return bool((board[:, 1:] == board[:, :-1]).any() or (board[1:, :] == board[:-1, :]).any())


def render_board(board: Any) -> str:
    """Rows of right-aligned numbers, ``.`` for empty cells."""
    board = np.asarray(board)
    cells = [[str(int(v)) if v else "." for v in row] for row in board]
    width = max(len(s) for row in cells for s in row)
    return "\n".join(" ".join(s.rjust(width) for s in row) for row in cells)


@lru_cache(maxsize=1 << 16)
def _slide_tuple(line: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(slide_row(line)[0])


def _after(rows: tuple[tuple[int, ...], ...], action: int) -> tuple[tuple[int, ...], ...] | None:
    """``rows`` after ``action`` (no spawn), or None if the move changes nothing. Pure Python, for the expert."""
    if action in (UP, DOWN):
        lines = tuple(zip(*rows))
    else:
        lines = rows
    if action in (RIGHT, DOWN):
        slid = tuple(_slide_tuple(line[::-1])[::-1] for line in lines)
    else:
        slid = tuple(_slide_tuple(line) for line in lines)
    if slid == lines:
        return None
    return tuple(zip(*slid)) if action in (UP, DOWN) else slid


@lru_cache(maxsize=16)
def _snake_weights(size: int) -> tuple[tuple[float, ...], ...]:
    """Cell weights along a snake path from the top-left corner, each a quarter of the one before."""
    weights = [[0.0] * size for _ in range(size)]
    for k in range(size * size):
        r, c = divmod(k, size)
        weights[r][c if r % 2 == 0 else size - 1 - c] = 4.0**-k
    return tuple(tuple(row) for row in weights)


def _snake_value(rows: tuple[tuple[int, ...], ...], weights: tuple[tuple[float, ...], ...]) -> float:
    return sum(w * v for wrow, row in zip(weights, rows) for w, v in zip(wrow, row))


def best_move(board: Any) -> int:
    """The expert's move (an action id): a deterministic two-move lookahead with the corner strategy.

    A board is valued by its tiles weighted along a snake path from the top-left corner, each
    cell a quarter of the one before (big tiles in the corner, sorted along the snake). Each
    move that changes the board is scored by the average, over the empty cells where the next
    2 can spawn, of the best follow-up move's board value; a spawn that leaves no move scores
    -1 (a loss). 4-spawns are not simulated (weighting them in doubled the cost and changed
    nothing over 10 seeded games). The highest average wins, ties going to the first of Up,
    Left, Right, Down; if no move changes the board (the game is over), Up. About 1-2 ms per
    move on a 4x4 board; it reached 2048 in 8 of 10 full games (seeds 0..9, default config).
    """
    rows = tuple(tuple(int(v) for v in row) for row in np.asarray(board))
    weights = _snake_weights(len(rows))
    best, best_value = UP, -math.inf
    for action in (UP, LEFT, RIGHT, DOWN):
        after = _after(rows, action)
        if after is None:
            continue
        empty = [(r, c) for r, row in enumerate(after) for c, v in enumerate(row) if not v]
        total = 0.0
        for r, c in empty:
            spawned = tuple(row if i != r else row[:c] + (2,) + row[c + 1 :] for i, row in enumerate(after))
            values = [_snake_value(f, weights) for f in (_after(spawned, a) for a in (UP, LEFT, RIGHT, DOWN)) if f is not None]
            total += max(values) if values else -1.0
        value = total / len(empty)
        if value > best_value:
            best, best_value = action, value
    return best


def _tile(value: Any) -> int | None:
    """One cell of a given board as an int, or None if it is not a whole number.

    Ints, NumPy integers, whole floats (``2.0``, as a float array holds them) and digit strings (``"8"``) are whole;
    ``2.5``, NaN, inf, ``True`` and ``"x"`` are not: ``int()`` made a 2.5 a 2 tile (and ``True`` a 1) without a word.
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return int(value) if math.isfinite(value) and float(value).is_integer() else None
    if isinstance(value, str) and value.strip().isdecimal():  # exactly the digits int() reads
        return int(value)
    return None


def _parse_board(given: Any, size: int, target: int) -> np.ndarray:
    """``reset``'s ``options["board"]`` as a ``size`` x ``size`` int64 board; ``ValueError`` naming what is wrong."""
    not_ints = f"game2048: board must be {size} rows of {size} ints (0 = empty)"
    try:
        cells = [list(row) for row in given]
    except TypeError:
        raise ValueError(f"{not_ints}, got {given!r}") from None
    rows = []
    for r, row in enumerate(cells):
        rows.append([_tile(v) for v in row])
        if None in rows[-1]:
            bad = row[rows[-1].index(None)]
            raise ValueError(f"{not_ints}; row {r} holds {bad!r}, not a whole number")
    if len(rows) != size or any(len(row) != size for row in rows):
        raise ValueError(f"game2048: board must be {size}x{size} to match size={size}, got {given!r}")
    for row in rows:
        for v in row:
            if v and (v < 2 or v & (v - 1) or v >= target):
                raise ValueError(f"game2048: board tiles must be 0 or powers of two in 2..{target // 2}, got {v}")
    board = np.array(rows, dtype=np.int64)
    if not can_move(board):
        raise ValueError("game2048: board has no possible move (the game would already be over)")
    return board
