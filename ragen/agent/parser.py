"""Parse a model response ``<think>…</think><answer>a1 || a2</answer>`` into action strings.

Model output is untrusted: :func:`parse_response` never raises, whatever the text. A
response that does not follow the format comes back with ``format_valid=False`` and the
reason, and the rollout turns that into a format penalty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_THINK_ANSWER = re.compile(r"\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)
_ANSWER_ONLY = re.compile(r"\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


@dataclass
class ParsedResponse:
    think: str | None
    answer: str | None
    #: Action strings in order, at most ``max_actions`` (extra ones are dropped, as in RAGEN).
    actions: list[str] = field(default_factory=list)
    format_valid: bool = False
    #: Why the format is invalid ("" when valid).
    error: str = ""


def parse_response(text: str, *, enable_think: bool = True, max_actions: int = 1, action_sep: str = "||") -> ParsedResponse:
    """Split ``text`` into think, answer and up to ``max_actions`` action strings.

    With ``enable_think`` the whole response must be ``<think>T</think><answer>A</answer>``
    (surrounding white space allowed); without it, ``<answer>A</answer>``. Tags may not
    nest or repeat, and ``A`` must hold at least one non-empty action. An empty ``action_sep`` does not split ``A``
    (the run config refuses one; this never raises, whatever the arguments' text).
    """
    if not isinstance(text, str):
        return ParsedResponse(None, None, error=f"response is not text ({type(text).__name__})")
    match = (_THINK_ANSWER if enable_think else _ANSWER_ONLY).fullmatch(text)
    if match is None:
        expected = "<think>...</think><answer>...</answer>" if enable_think else "<answer>...</answer>"
        return ParsedResponse(None, None, error=f"response does not match {expected}")
    think = match.group("think").strip() if enable_think else None
    answer = match.group("answer")
    if any(tag in part for part in (answer, think or "") for tag in _TAGS):
        return ParsedResponse(think, answer.strip(), error="nested or repeated tags")
    actions = [a.strip() for a in (answer.split(action_sep) if action_sep else [answer])]  # '': one action
    actions = [a for a in actions if a]
    if not actions:
        return ParsedResponse(think, answer.strip(), error="empty answer")
    return ParsedResponse(think, answer.strip(), actions[: max(1, max_actions)], format_valid=True)
