"""Optimal play on one lake for the expert agent and the optimality metrics: the finite- and infinite-horizon
policies, turn plans, and success probabilities."""

from __future__ import annotations

from typing import Any

import numpy as np

from ragen.envs.frozen_lake.model import MAX_OPEN_LOOP, TIE, LakeModel, _first_best
from ragen.envs.frozen_lake.policy_iteration import _solve_infinite


class LakeSolver:
    """Optimal play on one map: the infinite-horizon policy, the finite-horizon one, and turn plans.

    *Finite horizon* (``k`` moves left), by backward induction over (moves remaining, state),
    exact for gymnasium's ``P``::

        V_0(s) = 1[s = G]
        V_k(s) = max_a sum_s2 P(s2 | s, a) V_{k-1}(s2)      (G and holes absorbing: V_k(G) = 1, V_k(H) = 0)
        pi_k(s) = an argmax of the same sum

    ``V_k(s)`` is the highest probability of reaching the goal within ``k`` moves from ``s``
    that any policy achieves (which may depend on the moves left, unlike the infinite-horizon
    policy: with a few moves left it takes risks the unlimited policy never takes). Ties
    keep the infinite-horizon action, so with zero chance left the policy still heads
    safely for the goal, and with many moves left it coincides with :func:`solve`'s; other
    ties go to the first tied action in gym order (Left, Down, Right, Up; :func:`_first_best`).

    *Turns of several moves* (slippery ice, the agent sees the state only at the start of
    each turn and answers up to ``m`` moves at once): the best value with ``j`` turns and
    ``n`` moves left is, over open-loop sequences ``w`` of ``1..min(m, n)`` moves,

        U(j, n)(s) = max_w [ P(reach G during w | s) + sum_s2 P(end the turn on s2 | s, w) U(j-1, n-|w|)(s2) ]

    with ``U(0, n) = U(j, 0) = V_0``, and ``U(j, n) = V_n`` once ``j >= n`` (one move per turn
    is then possible, and nothing does better than closed-loop play). :meth:`turn_plan` is
    the maximising ``w`` (longest first among ties). Open-loop sequences are searched up to
    :data:`MAX_OPEN_LOOP` moves.
    """

    def __init__(self, env: Any):
        self.model = LakeModel.of(env)
        self.infinite_values, policy = _solve_infinite(self.model)
        self.infinite_policy = policy  # gym ids 0..3
        v0 = self.model.goal.astype(float)
        self._values = [v0]  # _values[k] = V_k
        self._actions = [policy.copy()]  # _actions[k][s] = pi_k(s), gym ids; row 0: the infinite-horizon action
        self._turn: dict[tuple[int, int, int], np.ndarray] = {}
        self._sequences: dict[int, list[tuple[int, ...]]] = {}

    # -- one move per decision -------------------------------------------------------------

    def _extend(self, horizon: int) -> None:
        while len(self._values) <= horizon:
            q = self.model.backup(self._values[-1])
            best = q.max(axis=0)
            keep = self.infinite_policy
            tied = q[keep, np.arange(q.shape[1])] >= best - TIE
            self._actions.append(np.where(tied, keep, _first_best(q)))
            values = best.copy()
            values[self.model.terminal] = 0.0
            values[self.model.goal] = 1.0
            self._values.append(values)

    def values(self, moves_left: int) -> np.ndarray:
        """``V_k`` for ``k = moves_left`` (a copy): per state, the best success probability within ``k`` moves."""
        k = max(0, int(moves_left))
        self._extend(k)
        return self._values[k].copy()

    def q_values(self, moves_left: int) -> np.ndarray:
        """``Q_k[a, s] = sum_s2 P(s2 | s, a) V_{k-1}(s2)`` (gym action ids ``a``), ``k = moves_left >= 1``."""
        return self.model.backup(self.values(int(moves_left) - 1))

    def action(self, state: int, moves_left: int | None = None) -> int:
        """The optimal action id (1..4) in ``state`` with ``moves_left`` moves left (None: infinite horizon)."""
        if moves_left is None:
            return int(self.infinite_policy[state]) + 1
        k = max(0, int(moves_left))
        self._extend(k)
        return int(self._actions[k][state]) + 1

    def path(self, state: int, moves_left: int | None = None, max_len: int = 1000) -> list[int]:
        """The moves the policy makes from ``state`` following each move's most likely outcome
        (the whole plan on deterministic ice); stops on a hole, the goal, a repeated state or no moves left."""
        model, out, seen = self.model, [], set()
        left = max_len if moves_left is None else min(int(moves_left), max_len)
        while left > 0 and not model.terminal[state] and state not in seen:
            seen.add(state)
            action = self.action(state, None if moves_left is None else left)
            out.append(action)
            likeliest, cell = model.likeliest(action - 1, state)
            if model.goal_prob[action - 1, state] >= likeliest:
                break  # most likely lands on the goal
            state = cell
            left -= 1
        return out

    # -- turns of several moves (open loop within a turn) ----------------------------------

    def _sequences_of(self, length: int) -> list[tuple[int, ...]]:
        """All sequences of ``length`` gym actions, first action slowest: ``(0, 0), (0, 1), ..., (3, 3)``."""
        if length not in self._sequences:
            rest = self._sequences_of(length - 1) if length > 1 else [()]
            self._sequences[length] = [(a,) + r for a in range(4) for r in rest]
        return self._sequences[length]

    def _sequence_scores(self, length: int, after: np.ndarray) -> np.ndarray:
        """``P(reach G during w | s) + sum_s2 P(end w on s2 | s) after(s2)`` for every sequence ``w`` of
        :meth:`_sequences_of` ``(length)``, shape ``(4**length, n_states)``.

        Built from the last move backwards, one sparse backup per move (a sequence ``(a,) + w`` scores
        ``backup`` of ``w``'s scores at ``a``), so it never forms an ``n x n`` matrix per sequence: those took
        ``4**length * 8 n^2`` bytes (680 MB for 4-move turns on a 24x24 map).
        """
        scores = np.asarray(after, dtype=float)[None]  # the empty sequence; backup zeroes the terminal states
        for _ in range(length):
            scores = self.model.backup(scores).reshape(-1, scores.shape[-1])  # (4, R, n): row a * R + r
        return scores

    def _turn_scores(self, turns_left: int, moves_left: int, per_turn: int) -> tuple[list[tuple[int, ...]], np.ndarray]:
        """Every candidate sequence of this turn and its value per start state, ``(len(seqs), n_states)``."""
        seqs_all, scores = [], []
        for length in range(min(per_turn, moves_left, MAX_OPEN_LOOP), 0, -1):
            after = self.turn_values(turns_left - 1, moves_left - length, per_turn)
            seqs_all += self._sequences_of(length)
            scores.append(self._sequence_scores(length, after))
        return seqs_all, np.concatenate(scores)

    def turn_values(self, turns_left: int, moves_left: int, per_turn: int) -> np.ndarray:
        """``U(j, n)``: per state, the best success probability with ``j`` turns of up to ``per_turn``
        moves each and ``n`` moves in all, seeing the state only at turn starts (class docstring)."""
        j, m = max(0, int(turns_left)), max(1, int(per_turn))
        n = min(max(0, int(moves_left)), j * m)
        if j >= n:
            return self.values(n)
        key = (j, n, m)
        if key not in self._turn:
            values = self._turn_scores(j, n, m)[1].max(axis=0)
            values[self.model.terminal] = 0.0
            values[self.model.goal] = 1.0
            self._turn[key] = values
        return self._turn[key].copy()

    def turn_plan(self, state: int, turns_left: int, moves_left: int, per_turn: int) -> list[int]:
        """This turn's optimal answer (action ids 1..4) from ``state``: one move when one move per turn
        is affordable (``turns_left >= moves_left``), else the best open-loop sequence of ``U``."""
        j, m = max(1, int(turns_left)), max(1, int(per_turn))
        n = min(max(1, int(moves_left)), j * m)
        if m == 1 or j >= n:
            return [self.action(state, n)]
        seqs, scores = self._turn_scores(j, n, m)
        column = scores[:, state]
        tied = np.flatnonzero(column >= column.max() - TIE)
        longest = max(len(seqs[i]) for i in tied)
        tied = [int(i) for i in tied if len(seqs[i]) == longest]  # ties: use every slot the turn allows...
        first = self.action(state, n) - 1  # ...and prefer opening with the closed-loop action
        pick = next((i for i in tied if seqs[i][0] == first), tied[0])
        return [a + 1 for a in seqs[pick]]


def solve(env: Any) -> dict[int, int]:
    """An optimal policy ``{state: action_id}`` (ids 1..4) for every non-terminal state.

    Policy iteration over gymnasium's transition table ``P`` (:func:`_solve_infinite`), undiscounted: it maximises
    the probability of *ever* reaching the goal (infinite horizon; ``max_steps`` is ignored).
    Among equally good actions (within 1e-14) it takes those that end the episode in the fewest expected moves
    (:func:`_fastest_policy`), and among equally fast ones (within a relative 1e-9) the first in gym order (Left,
    Down, Right, Up). So the policy really attains that probability (up to ~1e-14 per expected move: within
    1e-12 on slippery 32x32 maps at ``success_rate`` 0.9), and no optimal policy ends the episode in fewer expected
    moves (it never loops forever against a border; from the start of a slippery 32x32 map at 0.9, seed 0, ~1.0e4
    expected moves: the goal within 100_000 moves with probability 0.8813 of its 0.88135). Under a move cap this
    policy is not optimal (it never trades success probability for speed): see :func:`solve_finite`.
    """
    model = LakeModel.of(env)
    _, policy = _solve_infinite(model)
    return {s: int(policy[s]) + 1 for s in range(len(model.goal)) if not model.terminal[s]}


def solve_finite(env: Any, horizon: int) -> dict[int, dict[int, int]]:
    """The optimal policy within ``horizon`` moves: ``{k: {state: action_id}}`` for ``k = 1..horizon``
    moves left, by backward induction (:class:`LakeSolver`):
    ``V_k(s) = max_a sum_s2 P(s2 | s, a) V_{k-1}(s2)``, ``V_0 = 1[goal]``."""
    solver = LakeSolver(env)
    live = np.flatnonzero(~solver.model.terminal)
    return {k: {int(s): solver.action(int(s), k) for s in live} for k in range(1, int(horizon) + 1)}


def success_probability(env: Any, horizon: int | None = None) -> float:
    """The best probability of reaching the goal from the start.

    ``horizon=None``: undiscounted, infinite horizon (the value of :func:`solve`'s policy).
    ``horizon=N``: within ``N`` moves (e.g. the env's ``max_steps``, or an episode's move
    budget), the finite-horizon optimum ``V_N(start)`` of backward induction,
    ``V_k(s) = max_a sum_s2 P(s2 | s, a) V_{k-1}(s2)``, ``V_0 = 1[goal]`` (see
    :class:`LakeSolver`). It is >= :func:`policy_success_probability` of the infinite-horizon
    policy within the same ``N``, usually strictly on slippery ice.
    """
    solver = LakeSolver(env)
    start = solver.model.start
    if horizon is None:
        return float(solver.infinite_values[start])
    return float(solver.values(int(horizon))[start])


def turn_success_probability(env: Any, turns: int, actions_per_turn: int, max_actions: int | None = None) -> float:
    """The best success probability with ``turns`` turns of up to ``actions_per_turn`` moves each (at
    most ``max_actions`` in all), when the state is seen only at the start of each turn (``U`` of
    :class:`LakeSolver`). Equal to ``success_probability(env, turns)`` with one action per turn."""
    solver = LakeSolver(env)
    moves = turns * actions_per_turn if max_actions is None else min(max_actions, turns * actions_per_turn)
    return float(solver.turn_values(turns, moves, actions_per_turn)[solver.model.start])


def policy_success_probability(env: Any, horizon: int, policy: dict[int, int] | None = None) -> float:
    """Exact probability that a stationary ``policy`` (default :func:`solve`'s) reaches the goal
    within ``horizon`` moves, by propagating the state distribution ``horizon`` steps."""
    model = LakeModel.of(env)
    if policy is None:
        _, gym_policy = _solve_infinite(model)
    else:
        gym_policy = np.zeros(len(model.goal), dtype=int)
        for s, a in policy.items():
            gym_policy[s] = a - 1
    n_states = len(model.goal)
    idx = np.arange(n_states)
    succ, prob = model.succ[:, gym_policy, idx], model.prob[:, gym_policy, idx]  # (MAX_OUTCOMES, n): the policy's moves
    goal = model.goal_prob[gym_policy, idx]
    dist = np.zeros(n_states)
    dist[model.start] = 1.0
    reached = 0.0
    for _ in range(int(horizon)):
        reached += float(dist @ goal)
        dist = np.bincount(succ.ravel(), weights=(dist * prob).ravel(), minlength=n_states)
    return float(reached)
