"""MathQA: answer a math word problem (GSM8K / MetaMathQA style) in one turn."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any

from gymnasium import spaces

from ragen.envs.answer_env import SUBMIT, AnswerEnv  # noqa: F401  (SUBMIT: the one action id, importable here)
from ragen.envs.base import build_config
from ragen.envs.registry import register
from ragen.envs.render import check_render_mode

#: Ten grade-school problems shipped with ragen (GSM8K format); the default ``path``.
SAMPLE_PATH = str(Path(__file__).parent / "data" / "math_qa_sample.jsonl")

QUESTION_KEYS = ("question", "query", "problem")
ANSWER_KEYS = ("answer", "response", "solution")
_VERDICTS = {True: "Correct.", False: "Incorrect."}
_ASCII = "".join(chr(c) for c in range(32, 127)) + "\n"

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(rf"(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?")
_FRAC_RE = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_BOXED_RE = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_ANSWER_IS_RE = re.compile(r"the answer is\s*:?", re.IGNORECASE)
_CACHE: dict[tuple, list[tuple[str, str]]] = {}


@register("math_qa")
class MathQAEnv(AnswerEnv):
    """Answer one math word problem; the answer is compared numerically.

    ## Description
    Problems come from a local JSONL / JSON / parquet file (``path``, default: ten
    grade-school problems shipped with ragen), or, if the optional ``datasets`` package
    is installed, from a dataset by name (``dataset``, ``dataset_config``, ``split``).
    Each record needs a question field (``question``, ``query`` or ``problem``) and an
    answer field (``answer``, ``response`` or ``solution``). The gold answer is the text
    after GSM8K's ``####``, after MetaMathQA's ``The answer is:``, or inside
    ``\\boxed{}``; otherwise the whole field.

    ## Action Space
    The answer is free text, so the env uses a *pending answer*: ``parse_action(text)``
    stores ``text`` in ``self._pending_answer`` and returns the fixed id ``1``
    ("submit"); ``step(1)`` grades the stored answer (an empty answer if none was
    parsed; if several were parsed before a step, the last one). ``action_space`` is
    ``Discrete(1, start=1)``.

    ## Observation Space
    ``Text``: the question; after the step, followed by ``Correct.`` or ``Incorrect.``
    The charset is printable ASCII plus every character of the loaded questions.

    ## Starting State
    ``reset(seed=...)`` picks a problem with ``np_random`` (same seed, same problem);
    ``reset(options={"index": i})`` picks problem ``i``.

    ## Rewards
    1 if the answer is numerically equal to the gold answer, else 0. Both sides are
    normalised: ``$``, ``%`` and thousands separators are dropped, ``\\frac{a}{b}`` and
    ``a/b`` are fractions, decimals are exact (``0.5 == 1/2``), and the *last* number in
    the text counts (``"42 apples"`` -> 42). A gold answer without a number is compared
    as text (case- and space-insensitive).

    ## Episode End
    Terminated after the single step. Stepping again raises ``ValueError``.

    ## Information
    ``success`` (correct), ``action_is_valid`` (an answer could be read from the text),
    ``action_is_effective`` (same), ``index`` (the problem's index).

    ## Arguments
    ``path``, ``dataset``, ``dataset_config``, ``split``. A missing file, an unknown
    format, missing fields or an empty dataset raise ``ValueError``.
    """

    description = "MathQA: answer a math word problem (GSM8K / MetaMathQA style); graded numerically, single turn."
    instructions = (
        "Solve the math problem. Think step by step, then give only the final number as your answer, "
        "for example <answer>42</answer>."
    )
    name = "math_qa"

    @dataclass
    class Config:
        path: str = SAMPLE_PATH
        dataset: str = ""
        dataset_config: str = ""
        split: str = "train"

        def validate(self) -> None:
            if not self.dataset and not self.path:
                raise ValueError("math_qa: set path (a .jsonl/.json/.parquet file) or dataset (a datasets name)")

    def __init__(self, render_mode: str | None = None, **cfg: Any):
        self.config = build_config(self.Config, cfg, "math_qa")
        self.render_mode = check_render_mode("math_qa", render_mode, self.metadata["render_modes"])
        self.items = load_items(self.config)
        longest, charset = _question_text(tuple(self.items))
        self.observation_space = spaces.Text(min_length=0, max_length=longest, charset=charset)
        self.index = -1

    @property
    def question(self) -> str:
        return self.items[self.index][0] if self.index >= 0 else ""

    @property
    def gold_answer(self) -> str:
        return extract_gold(self.items[self.index][1]) if self.index >= 0 else ""

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        index = (options or {}).get("index")
        if index is None:
            index = int(self.np_random.integers(len(self.items)))
        elif isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.items):
            raise ValueError(f"math_qa: options['index'] must be an int in 0..{len(self.items) - 1}, got {index!r}")
        self.index = index
        self.begin_answer()
        return self.render(), {"index": index}

    def grade(self, answer: str) -> tuple[float, str, dict[str, Any]]:
        valid = bool(answer.strip()) and (to_number(answer) is not None or to_number(self.gold_answer) is None)
        correct = answers_match(answer, self.gold_answer)
        info = {"success": correct, "action_is_valid": valid, "action_is_effective": valid, "index": self.index}
        return 1.0 if correct else 0.0, _VERDICTS[correct], info

    def task_text(self) -> str:
        return self.question if self.index >= 0 else ""


@lru_cache(maxsize=8)
def _question_text(items: tuple[tuple[str, str], ...]) -> tuple[int, frozenset[str]]:
    """The longest observation and the charset of these problems (cached: a large data set took seconds an env)."""
    chars = set(_ASCII)
    for question, _ in items:
        chars.update(question)
    longest = max(len(q) for q, _ in items) + max(len(v) for v in _VERDICTS.values()) + 1
    return longest, frozenset(chars)


def extract_gold(answer: str) -> str:
    """The final answer inside a GSM8K / MetaMathQA / MATH solution text."""
    answer = str(answer)
    if "####" in answer:
        return answer.split("####")[-1].strip()
    found = list(_ANSWER_IS_RE.finditer(answer))
    if found:
        return answer[found[-1].end() :].strip()
    boxed = _BOXED_RE.findall(answer)
    if boxed:
        return boxed[-1].strip()
    return answer.strip()


def to_number(text: str) -> Fraction | None:
    """The last number in ``text`` as an exact fraction, or None."""
    text = _FRAC_RE.sub(r"(\1)/(\2)", str(text))
    boxed = _BOXED_RE.findall(text)
    if boxed:
        text = boxed[-1]
    text = text.replace("$", "").replace("%", "").replace("(", "").replace(")", "")
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    token = matches[-1].replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return Fraction(num) / Fraction(den) if Fraction(den) != 0 else None
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def _normalise_text(text: str) -> str:
    return " ".join(str(text).lower().replace("$", "").split()).rstrip(".")


def answers_match(answer: str, gold: str) -> bool:
    """Numeric equality after normalisation; text equality when the gold answer has no number."""
    gold_number = to_number(gold)
    if gold_number is None:
        return bool(_normalise_text(gold)) and _normalise_text(extract_gold(answer)) == _normalise_text(gold)
    return to_number(answer) == gold_number


def load_items(config: "MathQAEnv.Config") -> list[tuple[str, str]]:
    """``(question, answer)`` pairs from ``config``'s file or dataset; ``ValueError`` naming any problem."""
    if config.dataset:
        return _load_dataset(config)
    path = Path(config.path).expanduser()
    if not path.is_file():
        raise ValueError(f"math_qa: data file {str(path)!r} does not exist")
    key = (str(path.resolve()), os.path.getmtime(path))
    if key not in _CACHE:
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            records = _read_json(path)
        elif suffix == ".parquet":
            records = _read_parquet(path)
        else:
            raise ValueError(f"math_qa: data file {str(path)!r} must be .jsonl, .json or .parquet")
        _CACHE[key] = _to_items(records, str(path))
    return list(_CACHE[key])


def _read_json(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
            return data if isinstance(data, list) else data.get("data", [])
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"math_qa: data file {str(path)!r} is not valid JSON lines: {exc}") from None


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    except ImportError:
        pass
    try:
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    except ImportError:
        raise ValueError(f"math_qa: reading {str(path)!r} needs pyarrow or pandas; install one, or use JSONL") from None


def _load_dataset(config: "MathQAEnv.Config") -> list[tuple[str, str]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"math_qa: dataset={config.dataset!r} needs the optional 'datasets' package; install it or set path"
        ) from None
    key = ("datasets", config.dataset, config.dataset_config, config.split)
    if key not in _CACHE:
        args = [config.dataset] + ([config.dataset_config] if config.dataset_config else [])
        try:
            data = datasets.load_dataset(*args, split=config.split)
        except Exception as exc:
            raise ValueError(f"math_qa: could not load dataset {config.dataset!r}: {exc}") from None
        _CACHE[key] = _to_items(list(data), config.dataset)
    return list(_CACHE[key])


def _to_items(records: list, source: str) -> list[tuple[str, str]]:
    items = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"math_qa: record {i} of {source!r} is not an object")
        question = next((record[k] for k in QUESTION_KEYS if k in record), None)
        answer = next((record[k] for k in ANSWER_KEYS if k in record), None)
        if question is None or answer is None:
            raise ValueError(
                f"math_qa: record {i} of {source!r} needs one of {QUESTION_KEYS} and one of {ANSWER_KEYS}; "
                f"has {sorted(record)}"
            )
        items.append((str(question), str(answer)))
    if not items:
        raise ValueError(f"math_qa: {source!r} has no problems")
    return items
