"""One turn of an answer's actions outside the rollout: parse each action, step the env, and say what the next prompt
must tell (the expert recorder and ``ragen play`` share it; the rollout's own loop also keeps tokens and metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragen.envs.contract import checked_action_id, stepped


@dataclass
class TurnOutcome:
    observation: str  # the env's last observation (unchanged after an invalid answer)
    reward: float  # env rewards of the actions played, or the format penalty
    success: bool
    done: bool  # the env ended the episode (the caller adds its own turn and action budgets)
    actions_left: int | None  # the episode's remaining action budget (None: no budget)
    feedback: str  # what the next prompt says about an invalid answer ("" when valid)


def answer_turn(env: Any, actions: list[str], observation: str, success: bool, actions_left: int | None,
                format_penalty: float) -> TurnOutcome:
    """Play ``actions`` (already cut to the turn's limit): all of them if each names a valid action, at most
    ``actions_left`` of them, stopping where the episode ends; an empty answer or an unknown action changes
    nothing and costs ``format_penalty``."""
    raw = env.unwrapped
    ids = [checked_action_id(raw, a, raw.parse_action(a)) for a in actions]
    if not actions or None in ids:
        reason = f"unknown action {actions[ids.index(None)]!r}" if actions else "empty answer"
        return TurnOutcome(observation, format_penalty, success, False, actions_left,
                           f"Your answer was invalid ({reason}); the state did not change.")
    reward, done = 0.0, False
    for observation, r, terminated, truncated, info in stepped(env, ids if actions_left is None else ids[:actions_left]):
        reward += float(r)
        success = bool(info.get("success", False))
        actions_left = None if actions_left is None else actions_left - 1
        done = terminated or truncated
    return TurnOutcome(observation, reward, success, done, actions_left, "")
