"""Shaped reasoning rewards (RAGEN finding 6: without reward design, reasoning fades in multi-turn RL).

Two optional per-turn bonuses, each with its own weight, kept apart from the task reward
and never part of ``success``:

* **think** -- the turn's answer is well formed and its ``<think>`` is non-empty;
* **prediction** -- VAGEN's world-modelling reward: inside ``<think>`` the model writes
  ``<prediction>…</prediction>``, the state it expects after its actions, and it is compared
  *exactly* with the env's true next observation (no LLM judge). Before comparing, both
  texts lose leading/trailing blank space and each line its trailing spaces; nothing else
  is forgiven (case, inner spacing, symbols all count).
"""

from __future__ import annotations

import re

_PREDICTION = re.compile(r"<prediction>(.*?)</prediction>", re.DOTALL)


def extract_prediction(think: str | None) -> str | None:
    """The text of the single ``<prediction>…</prediction>`` in ``think``; None if absent or repeated."""
    if not think:
        return None
    found = _PREDICTION.findall(think)
    return found[0] if len(found) == 1 else None


def normalise_state(text: str) -> str:
    """Strip the whole text and each line's trailing blanks (the only slack the comparison allows)."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def prediction_matches(prediction: str | None, observation: str) -> bool:
    """True iff ``prediction`` equals ``observation`` up to :func:`normalise_state`."""
    return prediction is not None and normalise_state(prediction) == normalise_state(observation)


def think_is_well_formed(format_valid: bool, think: str | None) -> bool:
    """A parsed-and-valid answer whose ``<think>`` holds something besides blank space."""
    return bool(format_valid and think and think.strip())
