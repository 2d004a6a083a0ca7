"""Baseline agents: a seeded random agent (lower bound) and a solver-backed expert (upper bound).

Agents answer in *text*, exactly what a model would write inside ``<answer>…</answer>``:
``agent.act(env)`` returns a list of action strings, and :func:`run_episode` sends each
through ``env.parse_action`` before stepping, like the rollout does. So the expert's
episodes can double as SFT data, and a baseline that scores here scores the same way in
``ragen eval``.

>>> from ragen.envs.agents import ExpertAgent, evaluate_agent
>>> evaluate_agent("sokoban", {}, ExpertAgent(), seeds=range(5))["success"]
1.0

The expert per env:

* ``sokoban`` -- :func:`ragen.envs.sokoban.solve` (breadth-first search: a shortest plan,
  re-planned from the current position each turn);
* ``frozen_lake`` -- :class:`ragen.envs.frozen_lake.LakeSolver`: with a known episode
  budget (:class:`Budget`, given by :func:`run_episode`, :func:`evaluate_agent`,
  :func:`ragen.agent.conversation.record_conversation` and so ``ragen eval`` and ``ragen sft generate``), the
  finite-horizon optimal policy for the moves left (backward induction,
  ``V_k(s) = max_a sum P(s'|s,a) V_{k-1}(s')``, ``V_0 = 1[goal]``); on slippery ice with
  turns of several actions, the open-loop sequence that is optimal given the state at the
  turn's start (one action per turn when the turns left allow one per move left).
  Without a budget, :func:`ragen.envs.frozen_lake.solve` (policy iteration: the policy that
  maximises the probability of ever reaching the goal; one action per turn when the ice
  is slippery, since the next state is random);
* ``countdown`` -- :func:`ragen.envs.countdown.solve` (brute force over expressions);
* ``sudoku`` -- :func:`ragen.envs.sudoku.solve` (backtracking) on the current grid;
* ``game2048`` -- :func:`ragen.envs.game2048.best_move` (a deterministic heuristic, not a
  solver: two-move lookahead with the corner strategy; one move per turn, since the next
  tile is random);
* ``bandit`` -- the arm with the higher expected payoff (``env.best_action``: the high arm under the defaults);
* ``math_qa`` -- the stored gold answer;
* any other env -- its ``expert_actions()`` method if it has one (see
  ``examples/custom_env.py``), else ``ValueError``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

import ragen.envs
from ragen.envs.contract import checked_action_id, checked_reset, stepped


@dataclass(frozen=True)
class Budget:
    """An episode's limits as the rollout applies them (``None``: no limit of that kind).

    ``max_turns`` turns (``agent.max_turn``), each answering up to ``max_actions_per_turn``
    actions (extra ones are dropped), at most ``max_actions`` actions in the episode
    (``agent.max_actions_per_traj``; the rollout's 0 means none). The env's own step limit
    (FrozenLake's ``max_steps``) applies on top.
    """

    max_turns: int | None = None
    max_actions_per_turn: int | None = None
    max_actions: int | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> "Budget":
        """The budget of :class:`ragen.agent.rollout.AgentConfig` (``max_actions_per_traj`` 0 = no cap)."""
        return cls(settings.max_turn, settings.max_actions_per_turn, settings.max_actions_per_traj or None)

    def moves_left(self, turns_left: int | None, steps_taken: int, per_turn: int | None,
                   max_steps: int | None) -> int | None:
        """Moves the episode can still make: the least of the action cap and the env's ``max_steps``,
        each less the ``steps_taken`` so far, and ``turns_left`` times ``per_turn`` (None: unbounded)."""
        caps = []
        if self.max_actions is not None:
            caps.append(self.max_actions - steps_taken)
        if turns_left is not None and per_turn is not None:
            caps.append(turns_left * per_turn)
        if max_steps is not None:
            caps.append(int(max_steps) - steps_taken)
        return max(0, min(caps)) if caps else None


class Agent:
    """Base class: ``act(env)`` returns the action strings of one turn."""

    name = "agent"

    def begin_episode(self, env: Any, seed: int | None, budget: Budget | None = None) -> None:
        """Called after ``env.reset(seed=seed)``, before the first ``act``; ``budget`` is the
        episode's turn and action limits when the caller knows them (each ``act`` is one turn)."""

    def act(self, env: Any) -> list[str]:  # pragma: no cover - interface
        raise NotImplementedError


def begin_episode(agent: Agent, env: Any, seed: int | None, budget: Budget | None) -> None:
    """``agent.begin_episode(env, seed, budget)``, or without the budget for an agent written before it."""
    params = inspect.signature(agent.begin_episode).parameters
    takes_budget = "budget" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if takes_budget:
        agent.begin_episode(env, seed, budget=budget)
    else:
        agent.begin_episode(env, seed)


class RandomAgent(Agent):
    """Picks uniformly among ``env.action_lookup``'s ids and answers with the action's name.

    Each episode draws from a generator seeded by ``(seed, episode seed)``, so an
    episode's actions depend only on the two seeds, not on the episodes played before.
    Free-text envs (Countdown, MathQA) only list ``"submit"``, which grades as a
    malformed answer: the random agent is the zero-knowledge floor there.
    """

    name = "random"

    def __init__(self, seed: int = 0, max_actions_per_turn: int = 1):
        self.seed = int(seed)
        self.max_actions_per_turn = max(1, int(max_actions_per_turn))
        self.rng = np.random.default_rng(self.seed)

    def begin_episode(self, env: Any, seed: int | None, budget: Budget | None = None) -> None:
        # The whole seed, not its low 32 bits (seeds 2**32 apart used to replay the same draws on different
        # episodes); numpy splits a big int into 32-bit words, so seeds below 2**32 keep their old draws.
        if seed is not None and int(seed) < 0:
            raise ValueError(f"RandomAgent: the episode seed must be an int >= 0 (gymnasium's reset requires it), "
                             f"got {seed!r}")
        entropy = [self.seed] if seed is None else [self.seed, int(seed)]
        self.rng = np.random.default_rng(entropy)

    def act(self, env: Any) -> list[str]:
        lookup = env.unwrapped.action_lookup
        ids = sorted(lookup)
        picks = self.rng.integers(len(ids), size=self.max_actions_per_turn)
        return [lookup[ids[int(i)]] for i in picks]


class ExpertAgent(Agent):
    """Answers with each env's solver (see the module docstring); optimal where the solver is.

    ``max_actions_per_turn`` caps the actions of one answer (the plan is re-derived from
    the current state every turn, so a cap never loses optimality in deterministic envs).
    The :class:`Budget` given to :meth:`begin_episode` tells it how many turns and moves the
    episode has left at each ``act`` (each ``act`` call is one turn; moves already made are
    read from the env); FrozenLake's expert plays the optimal policy for that budget.
    Without a budget (an ``act`` before any ``begin_episode``, or a caller that gives none)
    it plays as if the episode had no limit.
    """

    name = "expert"

    def __init__(self, max_actions_per_turn: int | None = None):
        self.max_actions_per_turn = max_actions_per_turn
        self.budget: Budget | None = None
        self.turns_played = 0
        #: The moves left that the last plan was made for (FrozenLake with a budget; else None).
        self.last_moves_left: int | None = None
        #: The whole plan behind the last ``act`` (its head is the answer).
        self.last_plan: list[str] = []
        self._lake: tuple[Any, Any] | None = None  # (map key, LakeSolver)

    def begin_episode(self, env: Any, seed: int | None, budget: Budget | None = None) -> None:
        self.budget = budget
        self.turns_played = 0
        self.last_moves_left = None

    def act(self, env: Any) -> list[str]:
        self.last_plan = list(self.plan(env))
        self.turns_played += 1
        return self.last_plan[: self.turn_cap(env) or len(self.last_plan)]

    def turn_cap(self, env: Any) -> int | None:
        """Actions one answer may hold: the tighter of the agent's own cap and the budget's (None: no cap)."""
        caps = [c for c in (self.max_actions_per_turn, self.budget and self.budget.max_actions_per_turn) if c]
        return max(1, min(caps)) if caps else None

    def remaining(self, env: Any, steps_taken: int = 0, answer_len: int | None = None) -> tuple[int | None, int | None]:
        """``(turns_left, moves_left)`` of the episode at this ``act`` (including it), or ``(None, None)``
        without a budget. Moves left: the least of the budget's action cap, the turns left times the
        actions per turn (:meth:`turn_cap`, else ``answer_len``, the most the expert answers on this
        env; None: unbounded) and the env's ``max_steps``, less the ``steps_taken`` so far for the
        first and last."""
        budget = self.budget
        if budget is None:
            return None, None
        turns_left = None if budget.max_turns is None else max(0, budget.max_turns - self.turns_played)
        max_steps = getattr(getattr(env.unwrapped, "config", None), "max_steps", None)
        return turns_left, budget.moves_left(turns_left, steps_taken, self.turn_cap(env) or answer_len, max_steps)

    def plan(self, env: Any) -> list[str]:
        """Every action the expert would take from the current state (as far as it can tell)."""
        from ragen.envs.bandit import BanditEnv
        from ragen.envs.countdown import CountdownEnv
        from ragen.envs.frozen_lake import FrozenLakeEnv
        from ragen.envs.game2048 import Game2048Env
        from ragen.envs.math_qa import MathQAEnv
        from ragen.envs.sokoban import SokobanEnv
        from ragen.envs.sudoku import SudokuEnv

        env = env.unwrapped
        custom = getattr(env, "expert_actions", None)
        if callable(custom):
            return list(custom())
        if isinstance(env, SokobanEnv):
            return self._sokoban(env)
        if isinstance(env, FrozenLakeEnv):
            return self._frozen_lake(env)
        if isinstance(env, CountdownEnv):
            from ragen.envs.countdown import solve

            expr = solve(env.numbers, env.target)
            return [expr if expr is not None else str(env.numbers[0])]
        if isinstance(env, SudokuEnv):
            return self._sudoku(env)
        if isinstance(env, Game2048Env):
            from ragen.envs.game2048 import best_move

            return [env.action_lookup[best_move(env.board)]]
        if isinstance(env, BanditEnv):
            return [env.action_lookup[env.best_action]]
        if isinstance(env, MathQAEnv):
            return [env.gold_answer]
        raise ValueError(
            f"no expert for {type(env).__name__}: give the env an expert_actions() method returning answer strings"
        )

    @staticmethod
    def _sokoban(env: Any) -> list[str]:
        from ragen.envs.sokoban import solve

        plan = solve(env)
        if not plan:  # unsolvable from here (a box got stuck) or already solved: any move
            plan = [1]
        return [env.action_lookup[a] for a in plan]

    def lake_solver(self, env: Any):
        """The :class:`ragen.envs.frozen_lake.LakeSolver` of the env's current map (cached per map)."""
        from ragen.envs.frozen_lake import LakeSolver

        key = (tuple(env.desc), env.config.is_slippery, env.config.success_rate)
        if self._lake is None or self._lake[0] != key:
            self._lake = (key, LakeSolver(env))
        return self._lake[1]

    def _frozen_lake(self, env: Any) -> list[str]:
        """Without a budget: the infinite-horizon policy (one move on slippery ice, the whole path
        on deterministic ice). With one: the finite-horizon optimum for the moves left; on slippery
        ice with several actions per turn, the turn's optimal open-loop sequence (see
        :class:`ragen.envs.frozen_lake.LakeSolver`)."""
        solver = self.lake_solver(env)
        state = env.state
        names = env.action_lookup
        if solver.model.terminal[state]:
            return [names[1]]
        # Uncapped, the expert answers one move per turn on slippery ice, a whole path on deterministic ice.
        turns_left, moves_left = self.remaining(env, env.num_steps, None if solver.model.deterministic else 1)
        self.last_moves_left = None
        if moves_left is None:
            if solver.model.deterministic:
                return [names[a] for a in solver.path(state, None, max_len=env.config.max_steps)]
            return [names[solver.action(state)]]
        moves_left = max(1, moves_left)  # asked to act with nothing left: act as on the last move
        self.last_moves_left = moves_left
        if solver.model.deterministic:  # open loop is closed loop: the whole plan for the moves left
            return [names[a] for a in solver.path(state, moves_left)]
        per_turn = self.turn_cap(env) or 1
        if turns_left is None or per_turn == 1:
            return [names[solver.action(state, moves_left)]]
        return [names[a] for a in solver.turn_plan(state, max(1, turns_left), moves_left, per_turn)]

    @staticmethod
    def _sudoku(env: Any) -> list[str]:
        from ragen.envs.sudoku import solve

        grid = env.grid.tolist()
        solved = solve(grid)
        if solved is None:  # earlier (wrong) entries block the solution: aim at the stored one
            solved = env.solution.tolist()
        n = len(grid)
        return [
            f"r{r + 1}c{c + 1}={solved[r][c]}"
            for r in range(n)
            for c in range(n)
            if grid[r][c] != solved[r][c] and not env.givens[r, c]
        ]


AGENTS = {"random": RandomAgent, "expert": ExpertAgent}


def make_agent(name: str, **kwargs: Any) -> Agent:
    """``"random"`` or ``"expert"`` by name; ``ValueError`` for anything else."""
    if name not in AGENTS:
        raise ValueError(f"unknown agent {name!r}; known agents: {', '.join(AGENTS)}")
    return AGENTS[name](**kwargs)


def run_episode(
    env: Any,
    agent: Agent,
    seed: int | None = None,
    max_turns: int = 100,
    record: bool = False,
    max_actions_per_turn: int | None = None,
    max_actions: int | None = None,
) -> dict[str, Any]:
    """Play one episode; return ``success``, ``reward`` (env rewards summed), ``steps``, ``turns``.

    Each turn the agent's strings are parsed with ``env.parse_action``, all before any
    step (as the rollout does, which matters for envs that store a pending answer). If any
    string names no action, the turn is invalid and nothing is stepped
    (``invalid_turns`` counts them). As in the rollout, answers are cut to
    ``max_actions_per_turn`` actions and the episode to ``max_actions`` actions (None: no
    cap); the agent gets these limits and ``max_turns`` as its :class:`Budget`. With
    ``record``, ``transcript`` lists every turn as ``{"observation", "actions", "reward"}``
    (the observation the agent answered).
    """
    raw = env.unwrapped
    observation, _ = checked_reset(env, env.reset(seed=seed))
    begin_episode(agent, env, seed, Budget(max_turns, max_actions_per_turn, max_actions))
    reward, steps, turns, invalid, success, done = 0.0, 0, 0, 0, False, False
    transcript: list[dict[str, Any]] = []
    while not done and turns < max_turns:
        turns += 1
        actions = list(agent.act(env))
        if max_actions_per_turn is not None:
            actions = actions[: max(1, max_actions_per_turn)]
        ids = [checked_action_id(raw, a, raw.parse_action(a)) for a in actions]
        turn_reward = 0.0
        seen = observation
        if not actions or None in ids:
            invalid += 1
        else:
            for observation, r, terminated, truncated, info in stepped(env, ids if max_actions is None else ids[: max(0, max_actions - steps)]):
                steps += 1
                turn_reward += float(r)
                success = bool(info.get("success", False))
                done = terminated or truncated
        if max_actions is not None and steps >= max_actions:
            done = True
        reward += turn_reward
        if record:
            transcript.append({"observation": seen, "actions": actions, "reward": turn_reward})
    result = {"success": success, "reward": reward, "steps": steps, "turns": turns, "invalid_turns": invalid}
    if record:
        result["transcript"] = transcript
    return result


def evaluate_agent(
    env_name: str,
    env_cfg: dict[str, Any] | None,
    agent: Agent,
    seeds: Iterable[int],
    max_turns: int = 100,
    max_actions_per_turn: int | None = None,
    max_actions: int | None = None,
) -> dict[str, Any]:
    """Run ``agent`` on env ``env_name`` once per seed (:func:`run_episode` with these limits);
    return rates and means over episodes.

    Keys: ``success`` (success rate), ``reward_mean``, ``reward_std``, ``steps_mean``,
    ``invalid_turns_mean``, ``episodes``.
    """
    env = ragen.envs.make(env_name, **(env_cfg or {}))
    results = [run_episode(env, agent, seed=int(s), max_turns=max_turns, max_actions_per_turn=max_actions_per_turn,
                           max_actions=max_actions) for s in seeds]
    if not results:
        raise ValueError("evaluate_agent: seeds is empty")
    rewards = np.array([r["reward"] for r in results], dtype=float)
    return {
        "success": float(np.mean([r["success"] for r in results])),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "steps_mean": float(np.mean([r["steps"] for r in results])),
        "invalid_turns_mean": float(np.mean([r["invalid_turns"] for r in results])),
        "episodes": len(results),
    }


__all__ = ["Agent", "Budget", "begin_episode", "RandomAgent", "ExpertAgent", "make_agent", "run_episode", "evaluate_agent", "AGENTS"]
