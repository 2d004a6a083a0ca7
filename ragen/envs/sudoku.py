"""Sudoku (4x4 or 9x9) with text observations and moves like ``r2c3=4``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from ragen.envs.base import TextEnv, build_config
from ragen.envs.registry import register
from ragen.envs.render import check_render_mode

REWARD_ILLEGAL = -0.1
REWARD_SOLVED = 1.0
SIZES = (4, 9)

_CHARSET = frozenset("0123456789.|-+ \n")
# ASCII digits only (``\d`` would also match other scripts' digits, which ``int`` reads), and at most 3 of them: a
# longer run is no cell of a 9x9 grid, and ``int`` raises on a run of over 4300 digits.
_MOVE = re.compile(
    r"^\(?\s*r(?:ow)?\s*([0-9]{1,3})\s*[, ]?\s*c(?:ol)?\s*([0-9]{1,3})\s*\)?\s*[=:]\s*([0-9]{1,3})$",
    re.IGNORECASE | re.ASCII,
)


@register("sudoku")
class SudokuEnv(TextEnv):
    """Fill a small Sudoku: every row, column and box holds each digit once.

    ## Description
    A full solution is drawn from ``np_random`` (a base pattern shuffled by digits,
    rows within bands, bands, columns within stacks, stacks and transposition), then
    ``num_holes`` cells are emptied one at a time, each removal kept only if the puzzle
    still has a unique solution (checked by a backtracking solver). A given puzzle can
    be played with ``reset(options={"grid": ROWS})`` (0 = empty; at least one empty cell,
    a full grid is refused with ``ValueError``).

    ## Action Space
    ``Discrete(size**3, start=1)``: every move "write value v in row r, column c" has its
    own id ``((r-1)*size + (c-1))*size + v`` (1-based r, c, v), named ``r{r}c{c}={v}`` in
    ``action_lookup``. The move set is small and static, so moves are encoded in the id
    rather than stored by ``parse_action`` (the rollout parses *all* actions of a turn
    before stepping any, so one "pending move" slot would lose all but the last).
    ``parse_action`` accepts ``r2c3=4``, ``R2 C3 = 4``, ``row2col3:4`` and ``(r2,c3)=4``.

    ## Observation Space
    ``Text``: one line per row, digits or ``.`` for empty, ``|`` between boxes and a
    ``-``/``+`` line between bands.

    ## Starting State
    The generated puzzle (same seed, same puzzle).

    ## Rewards
    Illegal move (the cell is a given, or the value already appears in the row, column
    or box): -0.1 and the move is not applied. Legal move: 0 (players may overwrite
    their own entries). Completing the grid: +1. Since every applied move is legal and
    the solution is unique, a full grid is the solution.

    ## Episode End
    Terminated when solved; truncated after ``max_steps`` steps. Stepping after either
    raises ``ValueError``.

    ## Information
    ``success`` (solved), ``action_is_valid`` (always True: invalid ids raise),
    ``action_is_effective`` (the grid changed), ``illegal`` (the move broke a rule).

    ## Arguments
    ``size`` (4 or 9), ``num_holes`` (empty cells, 1..size*size-1), ``max_steps``,
    ``max_generation_tries``.
    """

    description = "Sudoku (4x4 or 9x9): fill the empty cells so each row, column and box has every digit once."

    @dataclass
    class Config:
        size: int = 4
        num_holes: int = 8
        max_steps: int = 100
        max_generation_tries: int = 20

        def validate(self) -> None:
            if self.size not in SIZES:
                raise ValueError(f"sudoku: size must be one of {SIZES}, got {self.size}")
            if not 1 <= self.num_holes < self.size * self.size:
                raise ValueError(
                    f"sudoku: num_holes must be in 1..{self.size * self.size - 1} for size {self.size}, got {self.num_holes}"
                )
            for key in ("max_steps", "max_generation_tries"):
                if getattr(self, key) <= 0:
                    raise ValueError(f"sudoku: {key} must be positive, got {getattr(self, key)}")

    def __init__(self, render_mode: str | None = None, **cfg: Any):
        self.config = build_config(self.Config, cfg, "sudoku")
        self.render_mode = check_render_mode("sudoku", render_mode, self.metadata["render_modes"])
        n = self.config.size
        self.action_lookup = {
            encode(r, c, v, n): f"r{r}c{c}={v}" for r in range(1, n + 1) for c in range(1, n + 1) for v in range(1, n + 1)
        }
        self.action_space = spaces.Discrete(n**3, start=1)
        box = math.isqrt(n)
        self.observation_space = spaces.Text(min_length=1, max_length=(2 * n + 2 * box) * (n + box), charset=_CHARSET)
        self.instructions = (
            f"You are solving a {n}x{n} Sudoku. Fill the empty cells (.) with digits 1-{n} so that every row, "
            f"every column and every {box}x{box} box contains each digit exactly once. Rows and columns are "
            f"numbered 1-{n} from the top-left. A move writes one digit, written r<row>c<column>=<digit>, "
            f"for example <answer>r1c2={n}</answer>. Moves that break a rule or change a given digit are rejected."
        )
        self.grid: np.ndarray | None = None
        self.givens: np.ndarray | None = None
        self.solution: np.ndarray | None = None
        self.num_steps = 0
        self._done = True

    def parse_action(self, text: str) -> int | None:
        """The id of the move ``text`` names (``r2c3=4``, ``R2 C3 = 4``, ...), else None; never raises."""
        if not isinstance(text, str):
            return None
        match = _MOVE.match(" ".join(text.split()))
        if not match:
            return None
        r, c, v = (int(g) for g in match.groups())
        n = self.config.size
        if not (1 <= r <= n and 1 <= c <= n and 1 <= v <= n):
            return None
        return encode(r, c, v, n)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start on a generated puzzle, or on ``options["grid"]`` (size x size ints, 0 = empty)."""
        super().reset(seed=seed)
        given = (options or {}).get("grid")
        c = self.config
        if given is None:
            puzzle, solution = generate(self.np_random, c.size, c.num_holes, c.max_generation_tries)
        else:
            puzzle = _parse_grid(given, c.size)
            if all(all(row) for row in puzzle):
                raise ValueError("sudoku: options['grid'] has no empty cell (0) to fill; give a grid with at least one")
            solved = solve(puzzle)
            if solved is None:
                raise ValueError("sudoku: options['grid'] has no solution")
            solution = np.array(solved)
        self.grid = np.array(puzzle, dtype=np.int64)
        self.givens = self.grid > 0
        self.solution = np.array(solution, dtype=np.int64)
        self.num_steps = 0
        self._done = False
        return self.render(), {"success": False}

    def step(self, action):
        action = self.check_action(action)
        if self._done:
            raise ValueError("sudoku: episode is over; call reset()")
        r, c, v = decode(action, self.config.size)
        self.num_steps += 1
        illegal = bool(self.givens[r, c]) or _conflicts(self.grid, r, c, v)
        effective = not illegal and self.grid[r, c] != v
        if effective:
            self.grid[r, c] = v
        success = bool((self.grid > 0).all())
        reward = REWARD_ILLEGAL if illegal else (REWARD_SOLVED if success and effective else 0.0)
        terminated = success
        truncated = not terminated and self.num_steps >= self.config.max_steps
        self._done = terminated or truncated
        info = {"success": success, "action_is_valid": True, "action_is_effective": bool(effective), "illegal": illegal}
        return self.render(), reward, terminated, truncated, info

    def render(self) -> str:
        if self.grid is None:
            return ""
        return render_grid(self.grid)


def encode(r: int, c: int, v: int, n: int) -> int:
    """Action id of writing ``v`` at 1-based row ``r``, column ``c``."""
    return ((r - 1) * n + (c - 1)) * n + v


def decode(action: int, n: int) -> tuple[int, int, int]:
    """0-based row, 0-based column and value of an action id."""
    cell, v = divmod(action - 1, n)
    r, c = divmod(cell, n)
    return r, c, v + 1


def render_grid(grid: Any) -> str:
    grid = np.asarray(grid)
    n = len(grid)
    box = math.isqrt(n)
    lines = []
    for r in range(n):
        if r and r % box == 0:
            lines.append("+".join(["-" * (2 * box - 1)] * box).replace("+", "-+-"))
        parts = [" ".join(str(v) if v else "." for v in grid[r, s : s + box]) for s in range(0, n, box)]
        lines.append(" | ".join(parts))
    return "\n".join(lines)


def _conflicts(grid: np.ndarray, r: int, c: int, v: int) -> bool:
    """Does ``v`` already appear in row ``r``, column ``c`` or their box (ignoring cell (r, c))?"""
    n = len(grid)
    box = math.isqrt(n)
    br, bc = r - r % box, c - c % box
    others = [grid[r, k] for k in range(n) if k != c] + [grid[k, c] for k in range(n) if k != r]
    others += [grid[i, j] for i in range(br, br + box) for j in range(bc, bc + box) if (i, j) != (r, c)]
    return v in others


def _parse_grid(given: Any, size: int) -> list[list[int]]:
    try:
        rows = [[int(v) for v in row] for row in given]
    except (TypeError, ValueError):
        raise ValueError(f"sudoku: grid must be {size} rows of {size} ints (0 = empty), got {given!r}") from None
    if len(rows) != size or any(len(row) != size for row in rows):
        raise ValueError(f"sudoku: grid must be {size}x{size} to match size={size}, got {given!r}")
    if any(not 0 <= v <= size for row in rows for v in row):
        raise ValueError(f"sudoku: grid values must be in 0..{size}, got {given!r}")
    grid = np.array(rows)
    for r, c in zip(*np.nonzero(grid)):
        if _conflicts(grid, int(r), int(c), int(grid[r, c])):
            raise ValueError(f"sudoku: grid has a conflict at r{r + 1}c{c + 1}")
    return rows


def _search(grid: list[list[int]], limit: int) -> list[list[list[int]]]:
    """Up to ``limit`` solutions of ``grid`` (bitmask backtracking, most constrained cell first)."""
    n = len(grid)
    box = math.isqrt(n)
    full = (1 << (n + 1)) - 2
    rows, cols, boxes = [0] * n, [0] * n, [0] * n
    empty = []
    for r in range(n):
        for c in range(n):
            v = grid[r][c]
            if v:
                bit = 1 << v
                rows[r] |= bit
                cols[c] |= bit
                boxes[(r // box) * box + c // box] |= bit
            else:
                empty.append((r, c))
    cells = [row[:] for row in grid]
    found: list[list[list[int]]] = []

    def rec() -> None:
        if len(found) >= limit:
            return
        best, best_free, best_count = -1, 0, n + 1
        for i, (r, c) in enumerate(empty):
            if cells[r][c]:
                continue
            free = full & ~(rows[r] | cols[c] | boxes[(r // box) * box + c // box])
            count = bin(free).count("1")
            if count < best_count:
                best, best_free, best_count = i, free, count
                if count <= 1:
                    break
        if best < 0:
            found.append([row[:] for row in cells])
            return
        r, c = empty[best]
        b = (r // box) * box + c // box
        for v in range(1, n + 1):
            bit = 1 << v
            if best_free & bit:
                cells[r][c] = v
                rows[r] |= bit
                cols[c] |= bit
                boxes[b] |= bit
                rec()
                cells[r][c] = 0
                rows[r] &= ~bit
                cols[c] &= ~bit
                boxes[b] &= ~bit
                if len(found) >= limit:
                    return

    rec()
    return found


def solve(grid: Any) -> list[list[int]] | None:
    """A solution of ``grid`` (rows of ints, 0 = empty; side 4 or 9) or None if it has none."""
    solutions = _search([[int(v) for v in row] for row in grid], 1)
    return solutions[0] if solutions else None


def count_solutions(grid: Any, limit: int = 2) -> int:
    """Number of solutions of ``grid``, counting at most ``limit``."""
    return len(_search([[int(v) for v in row] for row in grid], limit))


def generate(rng: np.random.Generator, size: int, num_holes: int, max_tries: int = 20) -> tuple[list[list[int]], list[list[int]]]:
    """A puzzle with exactly ``num_holes`` empty cells and a unique solution, and that solution."""
    box = math.isqrt(size)
    best = 0
    for _ in range(max_tries):
        digits = rng.permutation(size) + 1
        bands = rng.permutation(box)
        row_order = [int(b) * box + int(i) for b in bands for i in rng.permutation(box)]
        stacks = rng.permutation(box)
        col_order = [int(s) * box + int(i) for s in stacks for i in rng.permutation(box)]
        solution = [
            [int(digits[(box * (r % box) + r // box + c) % size]) for c in col_order] for r in row_order
        ]
        if rng.integers(2):
            solution = [list(col) for col in zip(*solution)]
        puzzle = [row[:] for row in solution]
        removed = 0
        for cell in rng.permutation(size * size):
            if removed == num_holes:
                break
            r, c = divmod(int(cell), size)
            value, puzzle[r][c] = puzzle[r][c], 0
            if count_solutions(puzzle, 2) == 1:
                removed += 1
            else:
                puzzle[r][c] = value
        if removed == num_holes:
            return puzzle, solution
        best = max(best, removed)
    raise ValueError(
        f"sudoku: could not empty {num_holes} cells of a {size}x{size} grid with a unique solution in "
        f"{max_tries} tries (best: {best}); use fewer num_holes"
    )
