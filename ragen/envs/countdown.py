"""Countdown: reach a target number with + - * / over given numbers (RAGEN's / TinyZero's Countdown)."""

from __future__ import annotations

import ast
import itertools
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gymnasium import spaces

from ragen.envs.answer_env import SUBMIT, AnswerEnv  # noqa: F401  (SUBMIT: the one action id, importable here)
from ragen.envs.base import build_config
from ragen.envs.registry import register
from ragen.envs.render import check_render_mode

REWARD_CORRECT = 1.0
REWARD_WELL_FORMED = 0.1
MAX_ANSWER_CHARS = 200

_CHARSET = frozenset("".join(chr(c) for c in range(32, 127)) + "\n")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@register("countdown")
class CountdownEnv(AnswerEnv):
    """Combine the given numbers with + - * / and parentheses to reach a target.

    ## Description
    Each ``reset`` draws 3-4 numbers in 1..99 and builds a random expression over all of
    them; its value (a positive integer <= ``max_target``) is the target, so every
    instance is solvable. The answer is an arithmetic expression using each given
    number at most once, checked by exact arithmetic (``ast`` + ``Fraction``; never
    ``eval``). Single turn.

    ## Action Space
    The answer is free text, so it does not fit in a small ``action_lookup``. The env
    uses a *pending answer*: ``parse_action(text)`` stores ``text`` in
    ``self._pending_answer`` and returns the fixed id ``1`` ("submit");
    ``step(1)`` evaluates the stored answer (an empty answer if none was parsed). If
    several answers are parsed before a step, the last one is evaluated.
    ``action_space`` is ``Discrete(1, start=1)``.

    ## Observation Space
    ``Text`` (printable ASCII): the numbers and the target; after the step, a verdict.

    ## Starting State
    Numbers and target drawn from ``np_random`` (same seed, same instance), or
    ``reset(options={"numbers": [...], "target": N})``.

    ## Rewards
    1 if the expression equals the target; 0.1 if it is well formed (parses, only
    + - * / parentheses and integer literals, every literal one of the given numbers,
    each at most as often as given) but wrong (including division by zero); else 0.
    An answer may end with ``= target`` (or start with ``target =``).

    ## Episode End
    Terminated after the single step. Stepping again raises ``ValueError``.

    ## Information
    ``success`` (correct), ``action_is_valid`` (well formed), ``action_is_effective``
    (same as valid), ``numbers``, ``target``.

    ## Arguments
    ``min_numbers``, ``max_numbers`` (count per instance, 2..6), ``max_number`` (numbers
    are drawn from 1..max_number), ``max_target``, ``max_generation_tries`` (draws of numbers
    before ``reset`` gives up with a ``ValueError``, e.g. when ``max_number`` is far above
    ``max_target``).

    :func:`solve` is a brute-force expert; :func:`check_answer` the checker.
    """

    description = "Countdown: combine given numbers with + - * / to hit a target number (single turn)."
    instructions = (
        "You are playing Countdown. Using the given numbers, each at most once, and the operations "
        "+, -, *, / and parentheses, write an arithmetic expression whose value is the target. "
        "Answer with the expression only, for example <answer>(25 - 5) * 3</answer>."
    )
    name = "countdown"
    observation_space = spaces.Text(min_length=0, max_length=512, charset=_CHARSET)

    @dataclass
    class Config:
        min_numbers: int = 3
        max_numbers: int = 4
        max_number: int = 99
        max_target: int = 100
        max_generation_tries: int = 100

        def validate(self) -> None:
            if not 2 <= self.min_numbers <= self.max_numbers <= 6:
                raise ValueError(
                    "countdown: need 2 <= min_numbers <= max_numbers <= 6, "
                    f"got min_numbers={self.min_numbers}, max_numbers={self.max_numbers}"
                )
            if self.max_number < 1:
                raise ValueError(f"countdown: max_number must be >= 1, got {self.max_number}")
            if self.max_target < 1:
                raise ValueError(f"countdown: max_target must be >= 1, got {self.max_target}")
            if self.max_generation_tries < 1:
                raise ValueError(f"countdown: max_generation_tries must be >= 1, got {self.max_generation_tries}")

    def __init__(self, render_mode: str | None = None, **cfg: Any):
        self.config = build_config(self.Config, cfg, "countdown")
        self.render_mode = check_render_mode("countdown", render_mode, self.metadata["render_modes"])
        self.numbers: list[int] = []
        self.target = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        if "numbers" in options or "target" in options:
            numbers, target = options.get("numbers"), options.get("target")
            if (
                not isinstance(numbers, (list, tuple))
                or not numbers
                or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numbers)
            ):
                raise ValueError(f"countdown: options['numbers'] must be a list of positive ints, got {numbers!r}")
            if not isinstance(target, int) or isinstance(target, bool):
                raise ValueError(f"countdown: options['target'] must be an int, got {target!r}")
            self.numbers, self.target = list(numbers), target
        else:
            self.numbers, self.target = generate(self.np_random, self.config)
        self.begin_answer()
        return self.render(), {"numbers": list(self.numbers), "target": self.target}

    def grade(self, answer: str) -> tuple[float, str, dict[str, Any]]:
        status = check_answer(answer, self.numbers, self.target)
        reward = {"correct": REWARD_CORRECT, "wrong": REWARD_WELL_FORMED, "malformed": 0.0}[status]
        verdict = {
            "correct": "Correct!",
            "wrong": "Wrong: the expression does not equal the target.",
            "malformed": "Invalid: not an expression over the given numbers.",
        }[status]
        info = {
            "success": status == "correct",
            "action_is_valid": status != "malformed",
            "action_is_effective": status != "malformed",
            "numbers": list(self.numbers),
            "target": self.target,
        }
        return reward, verdict, info

    def task_text(self) -> str:
        return f"Numbers: {self.numbers}. Target: {self.target}." if self.numbers else ""


#: Random expressions tried over each draw of numbers before drawing new numbers.
EXPRESSIONS_PER_DRAW = 50


def generate(rng, config: "CountdownEnv.Config") -> tuple[list[int], int]:
    """Numbers and a target reachable from all of them, drawn from ``rng``.

    Up to ``config.max_generation_tries`` draws of numbers, each with :data:`EXPRESSIONS_PER_DRAW` random
    expressions over them; a ``ValueError`` naming ``max_target`` and ``max_number`` when none hits a target in
    ``1..max_target`` (large numbers rarely combine to a small target).
    """
    for _ in range(config.max_generation_tries):
        count = int(rng.integers(config.min_numbers, config.max_numbers + 1))
        numbers = [int(n) for n in rng.integers(1, config.max_number + 1, size=count)]
        for _ in range(EXPRESSIONS_PER_DRAW):
            values = [Fraction(n) for n in numbers]
            order = list(rng.permutation(len(values)))
            values = [values[i] for i in order]
            while len(values) > 1:
                i, j = (int(k) for k in rng.choice(len(values), size=2, replace=False))
                a, b = values[i], values[j]
                op = int(rng.integers(4))
                if op == 3 and b == 0:
                    op = 0
                value = (a + b, a - b, a * b, a / b if b else a + b)[op]
                values = [v for k, v in enumerate(values) if k not in (i, j)] + [value]
            value = values[0]
            if value.denominator == 1 and 0 < value <= config.max_target:
                return numbers, int(value)
    raise ValueError(
        f"countdown: could not build a target in 1..max_target={config.max_target} from numbers in "
        f"1..max_number={config.max_number} in {config.max_generation_tries} tries; raise max_target, lower "
        "max_number or raise max_generation_tries"
    )


def _strip_equation(text: str, target: int) -> str:
    if text.count("=") == 1:
        left, right = (part.strip() for part in text.split("="))
        if right == str(target):
            return left
        if left == str(target):
            return right
    return text


def _evaluate(node: ast.AST, literals: list[int]) -> Fraction | None:
    """Exact value of an allowed expression tree (None after a division by zero).

    Raises ``ValueError`` for any node other than integer literals and binary + - * /.
    """
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, literals)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left = _evaluate(node.left, literals)
        right = _evaluate(node.right, literals)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        return left / right if right != 0 else None
    raise ValueError(f"not allowed: {type(node).__name__}")


def check_answer(text: Any, numbers: list[int], target: int) -> str:
    """``"correct"``, ``"wrong"`` (well formed, other value) or ``"malformed"``; never raises."""
    if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
        return "malformed"
    expr = _strip_equation(text.replace("\u00d7", "*").replace("\u00f7", "/").strip(), target)
    literals: list[int] = []
    try:
        value = _evaluate(ast.parse(expr, mode="eval"), literals)
    except Exception:  # SyntaxError, ValueError (null bytes, disallowed node), RecursionError, ...
        return "malformed"
    if not literals or Counter(literals) - Counter(numbers):
        return "malformed"
    return "correct" if value is not None and value == target else "wrong"


def solve(numbers: list[int], target: int) -> str | None:
    """An expression over some of ``numbers`` (each at most once) equal to ``target``, or None.

    Brute force: repeatedly combine two of the remaining values with + - * / (exact
    fractions), also trying to stop early when a single value hits the target.
    """
    goal = Fraction(target)
    start = [(Fraction(n), str(n)) for n in numbers]
    for value, expr in start:
        if value == goal:
            return expr
    seen: set[tuple] = set()

    def search(items: list[tuple[Fraction, str]]) -> str | None:
        key = tuple(sorted(v for v, _ in items))
        if key in seen:
            return None
        seen.add(key)
        for i, j in itertools.combinations(range(len(items)), 2):
            (a, ea), (b, eb) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            candidates = [(a + b, f"({ea} + {eb})"), (a * b, f"({ea} * {eb})"), (a - b, f"({ea} - {eb})"), (b - a, f"({eb} - {ea})")]
            if b != 0:
                candidates.append((a / b, f"({ea} / {eb})"))
            if a != 0:
                candidates.append((b / a, f"({eb} / {ea})"))
            for value, expr in candidates:
                if value == goal:
                    return expr[1:-1]
                if rest:
                    found = search(rest + [(value, expr)])
                    if found is not None:
                        return found
        return None

    return search(start)
