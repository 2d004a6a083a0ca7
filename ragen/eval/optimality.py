"""How close played episodes come to optimal play, where the env's optimum is known exactly.

For FrozenLake the optimal finite-horizon values are exact (:class:`~ragen.envs.frozen_lake.LakeSolver`),
which gives a far more precise estimate of a policy's success probability than counting
successes. With ``V*_h`` the best success probability within ``h`` moves and
``Q*_h(s, a) = sum_s2 P(s2 | s, a) V*_{h-1}(s2)``, the performance-difference identity for an
episode of moves ``t = 0 .. T-1`` (any policy, history-dependent or not) is::

    V^pi = V*_{h_0}(s_0) - E_pi[ sum_t ( V*_{h_t}(s_t) - Q*_{h_t}(s_t, a_t) ) + sum_jumps ( V*_h(s) - V*_h'(s) ) ]

where ``h_t`` is the move budget left before move ``t`` (one less after each move) and a
*jump* is a drop of the budget without a move: a turn that wasted its answer (invalid, or fewer
moves than the turn allows) or the episode ending with moves left. Every term is >= 0 (the
*regret*), the sum telescopes to ``V*_{h_0}(s_0) - 1[goal]`` in expectation, so

    value_estimate = mean over episodes of ( V*_{h_0}(s_0) - regret sum )

is an unbiased estimate of the policy's success probability on these maps. The report's
``optimum`` is the best success probability reachable with the episode's turn structure
(``LakeSolver.turn_values``: with several moves per turn on slippery ice the state is seen only
at turn starts, so it can be below ``V*_{h_0}(s_0)``, reported as ``closed_loop_optimum``); with
one move per turn the two are equal. Its error comes
only from the moves that were not optimal, so a near-optimal policy is measured to within a
few percent by episode counts where a success count would be off by ten.

On deterministic ice ``Q*_h(s, a) = V*_{h-1}(s2)`` and the estimate of one episode *is* its
success (0 or 1), which ``tests/eval/test_optimality.py`` checks on arbitrary move sequences.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import ragen.envs

#: Q* within this of the best value counts as an optimal move (ties between moves are common).
TIE = 1e-9


@dataclass
class EpisodeOptimality:
    """One episode against the exact optimum of its map."""

    seed: int
    #: ``V*_{h_0}(s_0)``: the best success probability within the episode's move budget if every
    #: move could react to the last slip (the estimate's reference).
    closed_loop_optimum: float
    #: The best success probability reachable with this episode's turns, moves per turn and move
    #: budget, seeing the state only at turn starts (``LakeSolver.turn_values``); equal to
    #: ``closed_loop_optimum`` with one move per turn, or on deterministic ice.
    turn_optimum: float
    #: The regret sum (>= 0); ``closed_loop_optimum - regret`` is this episode's unbiased value estimate.
    regret: float
    success: bool
    moves: int
    optimal_moves: int
    #: The env's observation text at the end of the replay (checked against the episode's).
    final_observation: str = ""

    @property
    def value_estimate(self) -> float:
        return self.closed_loop_optimum - self.regret


def lake_episode(env_config: dict[str, Any], seed: int, turns: Sequence[Sequence[int]], *, max_turns: int,
                 actions_per_turn: int, max_actions: int | None) -> EpisodeOptimality:
    """Replay one FrozenLake episode (``turns[k]``: the action ids the env executed in turn ``k``,
    empty for an invalid answer) from ``seed`` and score every move against the exact optimum.

    The budget before a decision is ``min(turns left * actions_per_turn, actions left, the env's
    max_steps - steps)``: what an optimal player could still use. The replay draws the same slips
    as the original episode (same seed, same actions). Raises ``ValueError`` if the moves cannot
    all be replayed under these limits (more turns or moves than allowed, moves after the end).
    """
    from ragen.envs.agents import Budget
    from ragen.envs.frozen_lake import LakeSolver

    env = ragen.envs.make("frozen_lake", **env_config)
    lake = env.unwrapped
    lake.reset(seed=seed)
    solver = LakeSolver(lake)
    limits = Budget(max_turns, actions_per_turn, max_actions)

    def budget(turns_left: int, steps: int) -> int:  # the expert plans with the same count (ExpertAgent.remaining)
        return limits.moves_left(turns_left, steps, actions_per_turn, lake.config.max_steps)

    if len(turns) > max_turns:
        raise ValueError(f"seed {seed}: {len(turns)} turns played, {max_turns} allowed")
    steps, done = 0, False
    h = budget(max_turns, 0)
    optimum = float(solver.values(h)[lake.state])
    turn_optimum = float(solver.turn_values(max_turns, h, actions_per_turn)[lake.state])
    regret, optimal_moves = 0.0, 0
    for k, actions in enumerate(turns):
        if done:
            if any(turns[k:]):
                raise ValueError(f"seed {seed}: moves after the episode ended (turn {k + 1})")
            break
        if len(actions) > actions_per_turn:
            raise ValueError(f"seed {seed}: turn {k + 1} made {len(actions)} moves, {actions_per_turn} allowed")
        for action in actions:
            if h <= 0 or done:
                raise ValueError(f"seed {seed}: turn {k + 1} moved past the move budget or the episode's end")
            s = lake.state
            q = solver.q_values(h)[:, s]  # (4,): gym ids 0..3 = env ids 1..4
            regret += float(solver.values(h)[s] - q[action - 1])
            optimal_moves += int(q[action - 1] >= q.max() - TIE)
            _, _, terminated, truncated, _ = lake.step(action)
            steps, h = steps + 1, h - 1
            done = terminated or truncated
        # The next turn's budget; a drop without moves (a short or invalid turn) is a jump.
        h_next = 0 if done else budget(max_turns - k - 1, steps)
        if h_next < h:
            values = solver.values(h)[lake.state], solver.values(h_next)[lake.state]
            regret += float(values[0] - values[1])
        h = min(h, h_next)
    if not done and h > 0:  # the episode stopped early (fewer turns played than allowed)
        regret += float(solver.values(h)[lake.state] - solver.values(0)[lake.state])
    return EpisodeOptimality(seed, optimum, turn_optimum, regret, lake._cell(lake.state) == "G", steps, optimal_moves,
                             lake._text())


def executed_actions(trajectory: Any, env: Any) -> list[list[int]]:
    """Per turn, the action ids the env executed (the rollout's ``Turn.actions_executed`` first parsed ones)."""
    raw = env.unwrapped
    out = []
    for turn in trajectory.turns:
        ids = [raw.parse_action(a) for a in turn.actions] if turn.format_valid else []
        out.append([int(i) for i in ids[: turn.actions_executed]])
    return out


def lake_optimality(trajectories: Sequence[Any], env_config: dict[str, Any], settings: Any) -> dict[str, Any] | None:
    """The optimality report of a FrozenLake evaluation's episodes (see the module docstring), or
    None if there is nothing to score. ``settings`` is the validation set's ``AgentConfig``.

    Raises ``RuntimeError`` if a replay does not reproduce an episode's outcome (the identity would
    then not hold, so no number is better than a wrong one).
    """
    env = ragen.envs.make("frozen_lake", **env_config)
    episodes = []
    for traj in trajectories:
        if traj.error:
            continue
        try:
            ep = lake_episode(env_config, traj.seed, executed_actions(traj, env), max_turns=settings.max_turn,
                              actions_per_turn=settings.max_actions_per_turn,
                              max_actions=settings.max_actions_per_traj or None)
        except ValueError as exc:
            raise RuntimeError(f"frozen_lake: the replay does not reproduce the episode: {exc}") from exc
        # The replay must be the episode: same outcome and final board (it replays exactly the
        # executed moves, or lake_episode raised above).
        final = traj.turns[-1].observation if traj.turns else traj.initial_observation
        if ep.success != bool(traj.success) or ep.final_observation != final:
            raise RuntimeError(f"frozen_lake seed {traj.seed}: the replay does not reproduce the episode "
                               f"(success {ep.success} vs {bool(traj.success)}, or a different final board)")
        episodes.append(ep)
    if not episodes:
        return None
    n = len(episodes)
    estimates = [ep.value_estimate for ep in episodes]
    successes = [float(ep.success) for ep in episodes]
    optimum = statistics.fmean(ep.turn_optimum for ep in episodes)
    value = statistics.fmean(estimates)

    def se(xs: list[float]) -> float:
        return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")

    moves = sum(ep.moves for ep in episodes)
    return {
        "episodes": n,
        "optimum": optimum,
        "closed_loop_optimum": statistics.fmean(ep.closed_loop_optimum for ep in episodes),
        "value_estimate": value,
        "value_estimate_se": se(estimates),
        "ratio_to_optimum": value / optimum if optimum > 0 else float("nan"),
        "success": statistics.fmean(successes),
        "success_se": se(successes),
        "regret_mean": statistics.fmean(ep.regret for ep in episodes),
        "episodes_with_regret": sum(ep.regret > TIE for ep in episodes),
        "optimal_move_rate": sum(ep.optimal_moves for ep in episodes) / moves if moves else float("nan"),
    }


__all__ = ["EpisodeOptimality", "executed_actions", "lake_episode", "lake_optimality"]
