"""Short, honest ``<think>`` rationales derived from a solver's plan (the text of SFT demonstrations).

Every sentence states something the solver or the env's state actually shows: where the
pieces are relative to each other, the plan the solver found, and which part of it this
turn's answer takes. Nothing is invented: when the solver has no plan (a Sokoban box got
stuck), the rationale says so.

>>> import ragen.envs
>>> env = ragen.envs.make("sokoban")
>>> _ = env.reset(seed=0)
>>> from ragen.envs.agents import ExpertAgent
>>> plan = ExpertAgent().plan(env)
>>> explain(env, plan, plan[:2]).startswith("The box is")
True
"""

from __future__ import annotations

from typing import Any


def explain(env: Any, plan: list[str], actions: list[str], moves_left: int | None = None) -> str:
    """Rationale for answering ``actions`` when the solver's whole plan from here is ``plan``
    (``moves_left``: the episode's moves left that the plan was made for, if it had a budget)."""
    from ragen.envs.bandit import BanditEnv
    from ragen.envs.frozen_lake import FrozenLakeEnv
    from ragen.envs.sokoban import SokobanEnv

    raw = env.unwrapped
    if isinstance(raw, SokobanEnv):
        return sokoban_rationale(raw, plan, actions)
    if isinstance(raw, FrozenLakeEnv):
        return frozen_lake_rationale(raw, plan, actions, moves_left)
    if isinstance(raw, BanditEnv):
        return bandit_rationale(raw, actions)
    return generic_rationale(plan, actions)


def offset_text(dr: int, dc: int, thing: str) -> str:
    """Where something is relative to ``thing``, ``dr`` rows down and ``dc`` columns right of it.

    >>> offset_text(2, -1, "the target")
    '2 rows below and 1 column left of the target'
    >>> offset_text(-1, 0, "me")
    '1 row above me'
    """
    def count(n: int, unit: str) -> str:
        return f"{abs(n)} {unit}{'s' if abs(n) != 1 else ''}"

    parts = []
    if dr:
        parts.append(f"{count(dr, 'row')} {'below' if dr > 0 else 'above'}")
    if dc:
        parts.append(f"{count(dc, 'column')} {'right of' if dc > 0 else 'left of'}")
    if not parts:
        return f"at {thing}"
    return " and ".join(parts) + f" {thing}"


def _moves(actions: list[str]) -> str:
    return ", ".join(actions)


def _plan_text(plan: list[str], limit: int = 12) -> str:
    """The plan, cut after ``limit`` moves (said so) to keep the rationale short."""
    if len(plan) <= limit:
        return f"{_moves(plan)} ({len(plan)} move{'s' if len(plan) != 1 else ''})"
    return f"{_moves(plan[:limit])}, ... ({len(plan)} moves)"


def sokoban_rationale(env: Any, plan: list[str], actions: list[str]) -> str:
    """Where the box stands relative to its target, the BFS plan, and the moves taken now."""
    from ragen.envs.sokoban.room import apply_move

    room = env.room
    names = {name: action_id for action_id, name in env.action_lookup.items()}
    after = room
    for name in plan:
        after = apply_move(after, names[name])
    loose = sorted(room.boxes - room.targets)
    free = sorted(room.targets - room.boxes)
    if len(loose) == 1 and len(free) == 1:
        (br, bc), (tr, tc) = loose[0], free[0]
        where = f"The box is {offset_text(br - tr, bc - tc, 'the target')}."
    else:
        where = f"{len(loose)} boxes are off their targets."
    if not after.solved:
        return f"{where} No plan solves the puzzle from here, so I try {_moves(actions)}."
    return f"{where} The shortest plan is {_plan_text(plan)}, so I move {_moves(actions)}."


def frozen_lake_rationale(env: Any, plan: list[str], actions: list[str], moves_left: int | None = None) -> str:
    """Where the goal is relative to the player, and the solver's path (or best next step(s) on slippery ice),
    for the ``moves_left`` the episode has left when the solver planned for a budget."""
    ncol = env.lake.ncol
    pr, pc = divmod(env.state, ncol)
    goal = next((r, c) for r, row in enumerate(env.desc) for c, ch in enumerate(row) if ch == "G")
    where = f"The goal is {offset_text(goal[0] - pr, goal[1] - pc, 'me')}."
    within = "" if moves_left is None else f" within the {moves_left} move{'s' if moves_left != 1 else ''} left"
    if env.config.is_slippery and env.config.success_rate < 1.0:
        if len(actions) > 1:
            return (
                f"{where} The ice is slippery and I see where I land only after this turn; "
                f"{_moves(actions)} gives the best chance of reaching the goal{within}."
            )
        return (
            f"{where} The ice is slippery, so I take one step at a time; "
            f"{_moves(actions)} gives the best chance of reaching the goal{within}."
        )
    path = "safe path" if moves_left is None else f"path for the {moves_left} move{'s' if moves_left != 1 else ''} left"
    return f"{where} The solver's {path} is {_plan_text(plan)}, so I move {_moves(actions)}."


def bandit_rationale(env: Any, actions: list[str]) -> str:
    """Each arm judged in the order listed (risky or safe job), then the verdict from the env's payoffs.

    The judgments come before the choice, so the first generated words describe the first
    listed name, not the answer (a rationale that opened with the chosen name decided before it
    reasoned: ``docs/study_bandit_think.md``). The words "Being a X is a" + " risky" / " safe"
    end the probe template under which the untrained model's own next-word odds rank all
    training names correctly (``docs/study_bandit_think.md``, "Knowledge probe"; the probe's
    template also opens with a question, which the rationale does not).
    """
    c = env.config
    high = env.action_lookup[env.high_action]
    high_mean, low_mean = c.high_prob * c.high_payoff, c.low_payoff
    judged = " ".join(
        f"Being {_article(name)} {name} is a {'risky' if name == high else 'safe'} job."
        for name in (env.action_lookup[1], env.action_lookup[2])
    )
    if high_mean == low_mean:
        verdict = "both arms pay the same on average"
    else:
        verdict = f"the {'risky' if high_mean > low_mean else 'safe'} arm is better"
    return (
        f"{judged} A risky arm pays {high_mean:g} on average, a safe one {low_mean:g}: "
        f"{verdict}, so I pull {_moves(actions)}."
    )


def _article(word: str) -> str:
    """'an' before a vowel letter, else 'a' (spelling, not sound: enough for the arm names)."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def generic_rationale(plan: list[str], actions: list[str]) -> str:
    """Any env with a solver: its plan and the part answered now."""
    if plan[: len(actions)] == actions and len(plan) > len(actions):
        return f"My plan from here is {_plan_text(plan)}, so I answer {_moves(actions)}."
    return f"My plan is {_moves(actions)}."


__all__ = ["explain", "sokoban_rationale", "frozen_lake_rationale", "bandit_rationale", "generic_rationale", "offset_text"]
