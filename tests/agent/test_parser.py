from hypothesis import given, strategies as st

from ragen.agent.parser import parse_response


def test_think_and_answer_with_several_actions():
    p = parse_response("<think>go up twice</think> <answer>Up || Up || Left</answer>", max_actions=2)
    assert p.format_valid and p.think == "go up twice"
    assert p.actions == ["Up", "Up"]  # capped at max_actions, as in RAGEN


def test_answer_only_mode():
    assert parse_response("<answer> Gambler </answer>", enable_think=False).actions == ["Gambler"]
    assert not parse_response("<think>x</think><answer>Gambler</answer>", enable_think=False).format_valid


def test_invalid_shapes_name_the_problem():
    assert "does not match" in parse_response("Up").error
    assert "does not match" in parse_response("<think>a</think><answer>Up</answer> trailing").error
    assert parse_response("<think>a</think><answer> || </answer>").error == "empty answer"
    assert parse_response("<think>a<answer>b</think><answer>Up</answer>").error == "nested or repeated tags"
    assert not parse_response(None).format_valid  # type: ignore[arg-type]


@given(st.text())
def test_never_raises_on_arbitrary_text(text):
    p = parse_response(text, max_actions=3)
    assert p.format_valid == (p.error == "")
    assert len(p.actions) <= 3


_word = st.text(st.characters(blacklist_characters="<>|", blacklist_categories=("Cs",)), min_size=1).filter(lambda s: s.strip())


@given(st.text(st.characters(blacklist_characters="<>", blacklist_categories=("Cs",))), st.lists(_word, min_size=1, max_size=4))
def test_well_formed_answers_round_trip(think, actions):
    text = f"<think>{think}</think><answer>{' || '.join(actions)}</answer>"
    p = parse_response(text, max_actions=4)
    assert p.format_valid
    assert p.actions == [a.strip() for a in actions]


def test_an_empty_action_separator_does_not_split_and_never_raises():
    """``str.split('')`` raises; the run config refuses an empty ``agent.action_sep``, and the parser keeps its
    never-raises promise for direct callers by reading the whole answer as one action."""
    parsed = parse_response("<answer> Left || Right </answer>", enable_think=False, max_actions=2, action_sep="")
    assert parsed.format_valid and parsed.actions == ["Left || Right"]
