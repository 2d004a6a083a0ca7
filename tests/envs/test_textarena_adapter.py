"""The optional TextArena adapter: a clear error without the package, a playable env with it."""

import importlib.util
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
