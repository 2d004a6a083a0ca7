"""The optional TextArena adapter: a clear error without the package, a playable env with it."""

import importlib.util
import random
import re
import warnings

import pytest

import ragen.envs

HAVE_TEXTARENA = importlib.util.find_spec("textarena") is not None


def test_registered_with_the_builtin_envs():
    assert "textarena" in ragen.envs.registered()


@pytest.mark.skipif(HAVE_TEXTARENA, reason="textarena is installed")
def test_missing_package_is_a_one_line_value_error():
    with pytest.raises(ValueError, match=r"pip install textarena"):
        ragen.envs.make("textarena")


@pytest.mark.skipif(not HAVE_TEXTARENA, reason="textarena is not installed")
def test_guess_the_number_by_binary_search():
    env = ragen.envs.make("textarena", game="GuessTheNumber-v0")
    obs, info = env.reset(seed=3)
    assert "Guess The Number" in env.instructions and info["game"] == "GuessTheNumber-v0"
    assert env.reset(seed=3)[0] == obs
    low, high, total = 1, 20, 0.0
    for _ in range(10):
        guess = (low + high) // 2
        obs, reward, terminated, truncated, info = env.step(env.parse_action(str(guess)))
        total += reward
        assert info["action_is_valid"]
        if terminated:
            break
        if re.search(r"higher", obs):
            low = guess + 1
        else:
            high = guess - 1
    assert terminated and info["success"] and total == 1.0
    with pytest.raises(ValueError):
        env.step(1)


@pytest.mark.skipif(not HAVE_TEXTARENA, reason="textarena is not installed")
def test_invalid_move_and_errors():
    env = ragen.envs.make("textarena", game="GuessTheNumber-v0")
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step(env.parse_action("no number here"))
    assert not info["action_is_valid"] and not terminated and "invalid" in obs.lower()
    with pytest.raises(ValueError, match="cannot make game"):
        ragen.envs.make("textarena", game="NoSuchGame-v0")
    with pytest.raises(ValueError, match="not a single-player game"):
        ragen.envs.make("textarena", game="TicTacToe-v0").reset(seed=0)


@pytest.mark.skipif(not HAVE_TEXTARENA, reason="textarena is not installed")
def test_check_env():
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(ragen.envs.make("textarena", game="GuessTheNumber-v0"))


def _minesweeper(seed: int):
    env = ragen.envs.make("textarena", game="Minesweeper-v0")
    env.reset(seed=seed)
    return env


def _move(env, text: str) -> str:
    return env.step(env.parse_action(text))[0]


MINESWEEPER_MOVES = ["[3 3]", "[0 0]", "[7 7]", "[5 1]"]


@pytest.mark.skipif(not HAVE_TEXTARENA, reason="textarena is not installed")
def test_envs_stepped_in_turn_play_the_game_of_their_own_seed():
    """TextArena seeds and draws from the global ``random`` (Minesweeper lays its mines at the first move): two envs
    of a group, reset with one seed and stepped in turn with the same moves, played different boards, and neither was
    the board a solo run of that seed gives."""
    solo = _minesweeper(0)
    solo_obs = [_move(solo, m) for m in MINESWEEPER_MOVES]
    a, b, other = _minesweeper(0), _minesweeper(0), _minesweeper(1)
    other_done = False
    for i, m in enumerate(MINESWEEPER_MOVES):
        if not other_done:  # an env on another seed, stepped in between (until it hits a mine)
            other_done = other.step(other.parse_action("[2 2]" if i == 0 else m))[2]
        assert _move(a, m) == solo_obs[i]
        assert _move(b, m) == solo_obs[i]


@pytest.mark.skipif(not HAVE_TEXTARENA, reason="textarena is not installed")
def test_the_callers_global_random_is_neither_reseeded_nor_advanced():
    random.seed(1234)
    expected = [random.random() for _ in range(5)]
    random.seed(1234)
    got = [random.random()]
    env = _minesweeper(0)
    got.append(random.random())
    _move(env, "[3 3]")
    got.append(random.random())
    env.reset(seed=0)
    _move(env, "[4 4]")
    got += [random.random(), random.random()]
    assert got == expected


@pytest.mark.skipif(not HAVE_TEXTARENA, reason="textarena is not installed")
def test_answers_parsed_before_stepping_are_sent_in_order():
    """The rollout parses all of a turn's answers (``<answer>5 || 7</answer>``) before stepping any: with one pending
    slot the first step sent the last answer and the second an empty move ``[]``."""
    queued = ragen.envs.make("textarena", game="GuessTheNumber-v0")
    queued.reset(seed=3)
    assert [queued.parse_action(a) for a in ("5", "7", "  ")] == [1, 1, None]
    one_by_one = ragen.envs.make("textarena", game="GuessTheNumber-v0")
    one_by_one.reset(seed=3)
    for guess in ("5", "7"):
        expected = one_by_one.step(one_by_one.parse_action(guess))
        got = queued.step(1)
        assert got[0] == expected[0] and got[4]["action_is_valid"], (guess, got)
    # reset drops answers still queued: the next step sends the next parsed answer, not a stale one
    queued.parse_action("9")
    queued.reset(seed=3)
    one_by_one.reset(seed=3)
    assert queued.step(queued.parse_action("12"))[0] == one_by_one.step(one_by_one.parse_action("12"))[0]


@pytest.mark.skipif(not HAVE_TEXTARENA, reason="textarena is not installed")
@pytest.mark.parametrize("mode", ["text", "ansi"])
def test_text_render_modes(mode):
    env = ragen.envs.make("textarena", game="GuessTheNumber-v0", render_mode=mode)
    obs, _ = env.reset(seed=3)
    assert env.render() == obs
