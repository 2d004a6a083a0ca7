"""What a prompt-independent policy scores: every fixed answer, repeated each turn, on a preset's validation seeds.

A policy that has collapsed to one answer (``collapse/cross_prompt_similarity`` near 1) plays the same actions
whatever the map shows. On RAGEN's FrozenLake the start is always top-left and the goal bottom-right, so such a
policy still succeeds on the maps whose holes miss its path. This script plays every answer of one to
``max_actions_per_turn`` actions, repeated every turn up to the tag's budgets, on the validation seeds
(``VAL_SEED_BASE + i``, the seeds ``ragen eval`` and validation use) through the real env, and prints each answer's
success with its 95 % Wilson interval, best first. A trained agent that scores no better than the best line here
has not shown that it reads the observation.

On deterministic FrozenLake it also searches every action sequence of the whole move budget, played blind: a
policy that counts its moves but never reads the map. With one move a turn no repeated answer can reach the goal,
so this line is the map-blind bar there; elsewhere it is at least the best fixed answer.

    .venv/bin/python scripts/fixed_answer_baseline.py frozenlake_study [--episodes 128] [--top 8]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np

from ragen.agent.env_sets import VAL_SEED_BASE, val_sets
import ragen.envs
from ragen.config import load_config
from ragen.envs.agents import Agent, evaluate_agent
from ragen.envs.frozen_lake import LakeModel
from ragen.errors import ConfigError
from ragen.eval.intervals import wilson


class FixedAnswerAgent(Agent):
    """Answers the same action names every turn, whatever the observation."""

    name = "fixed"

    def __init__(self, names: list[str]):
        self.names = names

    def act(self, env) -> list[str]:
        return list(self.names)


def best_blind_sequence(env_name: str, env_cfg: dict | None, seeds: list[int], budget: int) -> tuple[int, list[int]]:
    """``(wins, actions)``: the shortest sequence of at most ``budget`` actions that reaches the goal on the most
    ``seeds``.

    Exhaustive over the 4^budget sequences of deterministic FrozenLake, pruned by the best found: each seed's map
    is gymnasium's own transition table in arrays (:class:`ragen.envs.frozen_lake.LakeModel`), and a prefix is
    played on every map at once. An episode ends in a hole or on the goal, so a sequence scores the maps it reaches
    the goal on at any move.
    """
    env = ragen.envs.make(env_name, **(env_cfg or {})).unwrapped
    ids = sorted(env.action_lookup)  # our ids 1..4: gymnasium's 0..3, LakeModel's action axis, plus one
    nxt, to_goal, to_hole, start = [], [], [], []
    for seed in seeds:
        env.reset(seed=seed)
        model = LakeModel.of(env)
        if not model.deterministic:
            raise ValueError(f"{env_name}: a blind sequence search needs deterministic moves (is_slippery=false)")
        reached = model.goal_prob.T > 0  # (n, 4): the move lands on the goal
        nxt.append(model.succ[0].T), to_goal.append(reached)  # (n, 4): the cell a move leads to
        to_hole.append((model.prob[0].T == 0) & ~reached)  # (n, 4): no live cell and not the goal: a hole
        start.append(model.start)
    nxt, to_goal, to_hole = np.stack(nxt), np.stack(to_goal), np.stack(to_hole)  # (seeds, n, 4)
    rows = np.arange(len(seeds))
    best = [-1, []]

    def search(pos: np.ndarray, alive: np.ndarray, wins: int, sequence: list[int], length: int) -> None:
        if wins > best[0]:
            best[0], best[1] = wins, list(sequence)
        if len(sequence) == length or wins + int(alive.sum()) <= best[0]:
            return
        for a in range(len(ids)):
            reached = alive & to_goal[rows, pos, a]
            search(nxt[rows, pos, a], alive & ~reached & ~to_hole[rows, pos, a], wins + int(reached.sum()),
                   sequence + [ids[a]], length)

    found = (-1, [])
    for length in range(1, budget + 1):  # the shortest of the best: a longer search only adds moves when they help
        best[0], best[1] = -1, []
        search(np.array(start), np.ones(len(seeds), dtype=bool), 0, [], length)
        if best[0] > found[0]:
            found = (best[0], best[1])
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", help="a preset or YAML config whose first validation tag is played")
    parser.add_argument("--episodes", type=int, default=128, help="validation seeds (default 128)")
    parser.add_argument("--top", type=int, default=8, help="answers printed (default 8)")
    args = parser.parse_args()
    if args.episodes < 1 or args.top < 1:
        parser.error("--episodes and --top must be at least 1")  # one line on stderr, exit 2
    try:
        config = load_config(args.preset, [])
    except ConfigError as exc:  # a mistyped preset or a bad YAML: one line, exit 2, as the ragen command does
        print(f"fixed_answer_baseline: {exc}", file=sys.stderr)
        return 2
    tag_set = val_sets(config)[0]
    tag, agent = tag_set.tag, tag_set.settings
    env = tag.make_env().unwrapped
    space = env.action_space
    lookup = getattr(env, "action_lookup", None) or {a: str(a) for a in range(space.start, space.start + space.n)}
    actions = sorted(lookup)
    budget = agent.max_actions_per_traj or agent.max_turn * agent.max_actions_per_turn
    seeds = [VAL_SEED_BASE + i for i in range(args.episodes)]
    rows = []
    for length in range(1, agent.max_actions_per_turn + 1):
        for answer in itertools.product(actions, repeat=length):
            # the rollout's limits, through the same episode loop as ragen eval's random and expert baselines
            played = evaluate_agent(tag.env, tag.config, FixedAnswerAgent([lookup[a] for a in answer]), seeds,
                                    max_turns=agent.max_turn, max_actions_per_turn=agent.max_actions_per_turn,
                                    max_actions=agent.max_actions_per_traj or None)
            wins = round(played["success"] * played["episodes"])
            rows.append((wins / args.episodes, wilson(wins, args.episodes), answer))
    rows.sort(key=lambda r: -r[0])
    print(f"{tag.env} ({args.preset}): every fixed answer repeated each turn, {args.episodes} validation seeds "
          f"({VAL_SEED_BASE}..+{args.episodes - 1}), {agent.max_turn} turns, at most {budget} actions")
    print(f"{'answer':<32} success  95% CI")
    for rate, (lo, hi), answer in rows[: args.top]:
        text = " || ".join(lookup[a] for a in answer)
        print(f"{text:<32} {rate:7.3f}  {lo:.3f}-{hi:.3f}")
    if tag.env == "frozen_lake" and not env.config.is_slippery:
        wins, sequence = best_blind_sequence(tag.env, tag.config, seeds, budget)
        lo, hi = wilson(wins, args.episodes)
        print(f"best blind sequence of at most {budget} moves (the map never read): "
              f"{' '.join(lookup[a] for a in sequence)}  {wins / args.episodes:.3f}  {lo:.3f}-{hi:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
