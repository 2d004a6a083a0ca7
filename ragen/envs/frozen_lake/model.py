"""The lake as a Markov chain: gymnasium's transition table in arrays, and the backups the solvers run on it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ragen.envs.frozen_lake.env import _transitions


#: Two action values closer than this are a tie (then the infinite-horizon policy's action is kept).
TIE = 1e-12
#: On slippery ice a turn's plan is searched over all open-loop sequences of up to this many moves (4^k of them).
MAX_OPEN_LOOP = 4
#: Most outcomes of one move: the intended direction and, on slippery ice, the two perpendicular ones.
MAX_OUTCOMES = 3
#: Maps of at most this many cells (8x8) back up through the dense table (``32 n^2`` bytes: 131 kB here): one
#: ``(4, n, n)`` matmul instead of three gathers. On 4x4 maps, the common size, the gathers alone made
#: tests/eval/test_optimality.py's slippery-ice estimate test take 32.2 s instead of 14.6 s (12.4 s before the sparse
#: table); larger maps gather.
DENSE_MAX_CELLS = 64


@dataclass(frozen=True)
class LakeModel:
    """gymnasium's transition table ``P`` of one map as sparse arrays (gym action ids 0..3).

    A move has at most :data:`MAX_OUTCOMES` outcomes, so the table is kept as
    ``succ[k, a, s]`` / ``prob[k, a, s]``: the ``k``-th non-terminal cell that action ``a``
    can move ``s`` to, and its probability (outcomes into the same cell summed, sorted by
    cell, padded with cell 0 at probability 0; ``k`` first, so a backup is three whole-array
    multiply-adds). A dense ``(4, n, n)`` table takes ``32 n^2`` bytes (537 MB on a 64x64
    map) and ``4 n^2`` multiplications per backup, which made the expert take ~20 s on a
    slippery 24x24 map; this takes ``O(n)`` of both. ``goal_prob[a, s]`` is the probability
    of landing on the goal (a hole is lost mass). Terminal states (holes, goal) have no
    outcomes: nothing happens after them. :attr:`trans` is the dense table, built on demand
    (for inspecting small maps).
    """

    succ: np.ndarray
    prob: np.ndarray
    goal_prob: np.ndarray
    goal: np.ndarray
    terminal: np.ndarray
    start: int
    #: Every move has one outcome (not slippery, or ``success_rate`` 1).
    deterministic: bool

    @classmethod
    def of(cls, env: Any) -> "LakeModel":
        lake = _transitions(env)
        flat = lake.desc.ravel()
        n = len(flat)
        goal, terminal = flat == b"G", np.isin(flat, (b"G", b"H"))
        succ, prob = np.zeros((MAX_OUTCOMES, 4, n), dtype=np.intp), np.zeros((MAX_OUTCOMES, 4, n))
        goal_prob = np.zeros((4, n))
        deterministic = True
        for s in np.flatnonzero(~terminal):
            for a in range(4):
                outcomes: dict[int, float] = {}  # every cell reached (holes and goal too)
                live: dict[int, float] = {}  # the non-terminal ones
                for p, s2, _, done in lake.P[int(s)][a]:
                    if p <= 0:
                        continue
                    outcomes[int(s2)] = outcomes.get(int(s2), 0.0) + p
                    if goal[s2]:
                        goal_prob[a, s] += p
                    elif not done:
                        live[int(s2)] = live.get(int(s2), 0.0) + p
                for k, s2 in enumerate(sorted(live)):
                    succ[k, a, s], prob[k, a, s] = s2, live[s2]
                deterministic &= len(outcomes) == 1
        start = int(np.flatnonzero(flat == b"S")[0])
        return cls(succ, prob, goal_prob, goal, terminal, start, bool(deterministic))

    @cached_property
    def trans(self) -> np.ndarray:
        """The dense table ``trans[a, s, s2]``: the probability of moving from ``s`` to the non-terminal
        ``s2`` with action ``a`` (``O(n^2)`` memory: for inspecting small maps; the solvers use ``succ``/``prob``)."""
        n = len(self.goal)
        dense = np.zeros((4, n, n))
        a, s = np.indices((4, n))
        for succ, prob in zip(self.succ, self.prob):
            dense[a, s, succ] += prob
        return dense

    @cached_property
    def _trans_t(self) -> np.ndarray:
        """``trans`` with its last two axes swapped, contiguous: ``(4, s2, s)`` for :meth:`expect`'s small-map matmul."""
        return np.ascontiguousarray(self.trans.transpose(0, 2, 1))

    def expect(self, values: np.ndarray) -> np.ndarray:
        """``out[a, ..., s] = sum_s2 trans[a, s, s2] values[..., s2]`` for ``values`` of shape ``(..., n)``."""
        rows = values.reshape(-1, values.shape[-1])  # (R, n): gathering with [:, cells] is ~2x faster than [..., cells]
        if len(self.goal) <= DENSE_MAX_CELLS:  # (R, n) @ (4, n, n) -> (4, R, n): one small matmul beats three gathers
            return np.matmul(rows, self._trans_t).reshape(4, *values.shape)
        total = rows[:, self.succ[0]] * self.prob[0]  # (R, 4, n)
        for succ, prob in zip(self.succ[1:], self.prob[1:]):
            total += rows[:, succ] * prob
        return np.moveaxis(total, 1, 0).reshape(4, *values.shape)

    def backup(self, values: np.ndarray) -> np.ndarray:
        """``q[a, ..., s] = sum_s2 P(s2 | s, a) V(s2)`` for value vectors (shape ``(..., n)``) with ``V(G) = 1`` and
        ``V(hole) = 0``: ``(4, n)`` for one vector, ``(4, R, n)`` for ``R`` of them."""
        goal_prob = self.goal_prob.reshape(4, *(1,) * (values.ndim - 1), -1)
        return goal_prob + self.expect(np.where(self.terminal, 0.0, values))

    def outcomes(self, action: int, state: int) -> np.ndarray:
        """The non-terminal cells ``action`` (a gym id) can move ``state`` to, in increasing order."""
        return self.succ[:, action, state][self.prob[:, action, state] > 0]

    def likeliest(self, action: int, state: int) -> tuple[float, int]:
        """``(probability, cell)`` of the likeliest non-terminal outcome of ``action`` in ``state`` (the lowest
        cell among equals, as ``trans[action, state].argmax()``; ``(0.0, 0)`` when every outcome is terminal)."""
        k = int(self.prob[:, action, state].argmax())
        p = float(self.prob[k, action, state])
        return p, int(self.succ[k, action, state]) if p > 0 else 0


def _first_best(q: np.ndarray, tie: float = TIE) -> np.ndarray:
    """Per state (column), the first action whose value is within ``tie`` (:data:`TIE`) of the best.

    Not ``q.argmax(axis=0)``: actions that tie exactly (mirror-image moves on a symmetric map) come out a
    rounding error apart, in whichever direction the summation order of the backup happens to give, so a
    plain argmax picked between them by float noise. This picks the first, as exact arithmetic would.
    """
    return np.argmax(q >= q.max(axis=0) - tie, axis=0)
