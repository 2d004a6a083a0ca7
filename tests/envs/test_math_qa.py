"""MathQA env: sample data, answer extraction and numeric grading, file formats, bad input."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen.envs.math_qa import SAMPLE_PATH, SUBMIT, MathQAEnv, answers_match, extract_gold, to_number
from ragen.envs.registry import make


def answer(env: MathQAEnv, text: str):
    assert env.parse_action(text) == SUBMIT
    return env.step(SUBMIT)


def test_check_env_and_registry():
    check_env(MathQAEnv())
    env = make("math_qa")
    assert env.config.path == SAMPLE_PATH and len(env.items) == 10


def test_sample_answers_are_graded_correct():
    env = MathQAEnv()
    golds = []
    for i in range(len(env.items)):
        env.reset(options={"index": i})
        golds.append(env.gold_answer)
        obs, reward, terminated, truncated, info = answer(env, env.gold_answer)
        assert reward == 1.0 and terminated and not truncated and info["success"] and obs.endswith("Correct.")
    assert golds == ["27", "8", "210", "170", "18", "2,125", "150", "17", "5/8", "-7"]


@pytest.mark.parametrize(
    "text, index, correct",
    [
        ("27", 0, True),
        ("27 pencils", 0, True),
        ("The answer is: 27", 0, True),
        ("\\boxed{27}", 0, True),
        ("26", 0, False),
        ("$2,125", 5, True),
        ("2125.0", 5, True),
        ("0.625", 8, True),
        ("\\frac{5}{8}", 8, True),
        ("5/8 of the pizza", 8, True),
        ("3/8", 8, False),
        ("-7", 9, True),
        ("7", 9, False),
        ("I don't know", 0, False),
    ],
)
def test_grading(text, index, correct):
    env = MathQAEnv()
    env.reset(options={"index": index})
    _, reward, _, _, info = answer(env, text)
    assert reward == (1.0 if correct else 0.0) and info["success"] == correct
    if text == "I don't know":
        assert not info["action_is_valid"]


def test_gold_extraction_formats():
    assert extract_gold("so 3 + 4 = 7\n#### 7") == "7"
    assert extract_gold("Adding, we get 12. The answer is: 12") == "12"
    assert extract_gold("Thus $x = \\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert to_number("\\frac{1}{2}") == Fraction(1, 2)
    assert answers_match("(B)", "(b)") and not answers_match("(C)", "(B)")
    assert to_number("no digits") is None and to_number("1/0") is None


def test_single_turn_and_no_answer():
    env = MathQAEnv()
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(SUBMIT)
    assert reward == 0.0 and terminated and not info["action_is_valid"]
    with pytest.raises(ValueError, match="episode is over"):
        env.step(SUBMIT)
    assert env.parse_action("  ") is None


def test_same_seed_same_problem():
    assert MathQAEnv().reset(seed=4) == MathQAEnv().reset(seed=4)
    assert len({MathQAEnv().reset(seed=s)[0] for s in range(20)}) > 3


def test_metamath_jsonl_and_json(tmp_path):
    path = tmp_path / "meta.jsonl"
    path.write_text(json.dumps({"query": "What is 6 times 7?", "response": "6 * 7 = 42. The answer is: 42"}) + "\n")
    env = MathQAEnv(path=str(path))
    assert env.reset(seed=0)[0] == "What is 6 times 7?"
    assert answer(env, "42")[1] == 1.0
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"problem": "1+1?", "solution": "$\\boxed{2}$"}]))
    env = MathQAEnv(path=str(path))
    env.reset(seed=0)
    assert answer(env, "2")[1] == 1.0


def test_missing_file_names_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="nope.jsonl"):
        MathQAEnv(path=missing)


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("bad.jsonl", "{not json", "not valid JSON"),
        ("fields.jsonl", json.dumps({"q": "x", "a": "1"}), "needs one of"),
        ("empty.jsonl", "", "no problems"),
        ("data.csv", "question,answer", "must be .jsonl"),
    ],
)
def test_bad_files(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        MathQAEnv(path=str(path))


def test_bad_config_and_options():
    with pytest.raises(ValueError, match="set path"):
        MathQAEnv(path="")
    with pytest.raises(ValueError, match="unknown config key"):
        MathQAEnv(file="x")
    env = MathQAEnv()
    with pytest.raises(ValueError, match="index"):
        env.reset(options={"index": 10})
    env.reset(seed=0)
    with pytest.raises(ValueError, match="invalid action id"):
        env.step(2)


def test_dataset_without_datasets_package():
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="datasets"):
            MathQAEnv(dataset="gsm8k")
    else:  # pragma: no cover
        pytest.skip("datasets is installed")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_grading_never_raises(text):
    env = MathQAEnv()
    env.reset(seed=1)
    env._pending_answer = text
    _, reward, *_ = env.step(SUBMIT)
    assert reward in (0.0, 1.0)
