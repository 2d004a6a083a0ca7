"""What ragen reads from an env, checked where it reads it.

A user's env (``ragen.envs.register``) may break gymnasium's API in ways Python only notices later: a reward
that is a string, an ``info`` that is None, a dict observation that fails in the update three stages on.
ragen checks each value where it takes it and raises :class:`EnvContractError` with a sentence naming the
env and what was wrong; the rollout reports it as that episode's error (like an exception raised inside
``step``) and the run goes on.

What is checked (the contract in :mod:`ragen.envs.base`):

* at construction (:func:`interface_problem`): ``parse_action`` is callable; when the rollout starts an episode,
  its instructions (the env's ``instructions`` unless the agent settings or the tag give them) are a ``str``;
* ``reset`` returns ``(observation, info)`` with a ``str`` observation and a ``dict`` info;
* ``step`` returns ``(observation, reward, terminated, truncated, info)`` with a ``str`` observation, a finite
  real reward (Python or NumPy number, ``bool`` as 0/1, or a one-element array or tensor), flags that ``bool()`` accepts and a ``dict`` info;
* ``parse_action`` returns an ``int`` (NumPy integers too) or None.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Iterator

import numpy as np


class EnvContractError(ValueError):
    """An env returned something ragen cannot use; the message names the env and the value."""


def _name(env: Any) -> str:
    return type(getattr(env, "unwrapped", env)).__name__


def _kind(value: Any) -> str:
    return type(value).__name__


def _a(value: Any) -> str:
    """``value``'s type name after its article: "a dict", "an int"."""
    kind = _kind(value)
    return f"{'an' if kind[:1].lower() in 'aeiou' or kind == 'ndarray' else 'a'} {kind}"


def interface_problem(env: Any) -> str | None:
    """Why ``env`` lacks what the agent layer calls besides gymnasium's API (``parse_action``), or None.

    ``instructions`` are not required here: a run may give them (a tag's, ``es.tags.TAG.instructions``), or an env may set
    them in ``reset``; the rollout checks them when an episode starts (:func:`instructions_problem`)."""
    raw = getattr(env, "unwrapped", env)
    if not callable(getattr(raw, "parse_action", None)):
        return f"{_name(env)} has no `parse_action(text) -> int | None` method (ragen.envs.base.TextEnv has one)"
    return None


def instructions_problem(env: Any, instructions: Any) -> str | None:
    """Why ``instructions`` (the env's, or the run's override) cannot open a prompt, or None."""
    if isinstance(instructions, str):
        return None
    return (f"{_name(env)} has no text `instructions` (got {_kind(instructions)}): set a str `instructions` attribute "
            "(ragen.envs.base.TextEnv has one), or give them in the run config (es.tags.TAG.instructions)")


def _observation(env: Any, method: str, observation: Any) -> str:
    if not isinstance(observation, str):
        shown = f" of shape {tuple(observation.shape)}" if isinstance(observation, np.ndarray) else ""
        raise EnvContractError(f"{_name(env)}.{method} returned {_a(observation)}{shown} observation; "
                               "ragen envs return text (str) observations")
    return observation


def _info(env: Any, method: str, info: Any) -> dict:
    if not isinstance(info, dict):
        raise EnvContractError(f"{_name(env)}.{method} returned info of type {_kind(info)}; gymnasium's API returns a dict")
    return info


def _tuple(env: Any, method: str, result: Any, length: int, fields: str) -> tuple:
    if not isinstance(result, tuple) or len(result) != length:
        got = f"a {len(result)}-tuple" if isinstance(result, tuple) else _a(result)
        raise EnvContractError(f"{_name(env)}.{method} returned {got}; gymnasium's API returns {fields}")
    return result


def checked_reset(env: Any, result: Any) -> tuple[str, dict]:
    """``env.reset(...)``'s ``result`` as ``(observation, info)``, or :class:`EnvContractError`."""
    observation, info = _tuple(env, "reset", result, 2, "(observation, info)")
    return _observation(env, "reset", observation), _info(env, "reset", info)


def checked_reward(env: Any, reward: Any) -> float:
    """``reward`` as a finite float, or :class:`EnvContractError`.

    Python and NumPy numbers and bools count, and so does any one-element array or tensor (``np.array(1.0)``,
    ``torch.tensor([1.0])``: read with ``.item()``); text, complex numbers, several values or a non-finite value
    do not."""
    value = reward
    if not isinstance(value, (str, bytes, numbers.Number)) and callable(getattr(value, "item", None)):
        try:
            value = value.item()  # a NumPy scalar or one-element array/tensor; several elements raise
        except (ValueError, RuntimeError, TypeError):
            pass
    if isinstance(value, np.generic):
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise EnvContractError(f"{_name(env)}.step returned {_a(reward)} reward ({reward!r:.60}); "
                               "rewards are real numbers")
    try:
        value = float(value)
    except OverflowError:  # an int or Fraction beyond a float's range
        value = math.inf if value > 0 else -math.inf
    if not math.isfinite(value):
        raise EnvContractError(f"{_name(env)}.step returned a non-finite reward ({value})")
    return value


def _flag(env: Any, name: str, value: Any) -> bool:
    try:
        return bool(value)
    except Exception:  # a NumPy array of several values, an object whose __bool__ raises
        raise EnvContractError(f"{_name(env)}.step returned `{name}` = {value!r:.60}, which is not a truth value") from None


def checked_step(env: Any, result: Any) -> tuple[str, float, bool, bool, dict]:
    """``env.step(action)``'s ``result`` as ``(observation, reward, terminated, truncated, info)``, or
    :class:`EnvContractError`."""
    observation, reward, terminated, truncated, info = _tuple(
        env, "step", result, 5, "(observation, reward, terminated, truncated, info)")
    return (_observation(env, "step", observation), checked_reward(env, reward), _flag(env, "terminated", terminated),
            _flag(env, "truncated", truncated), _info(env, "step", info))


def stepped(env: Any, action_ids: Iterable[int]) -> Iterator[tuple[str, float, bool, bool, dict]]:
    """One turn's actions played in order: each ``env.step`` result, checked (:func:`checked_step`), up to and
    including the step that ends the episode. The one step loop of the rollout, the expert recorder and ``ragen
    play``; an env that raises raises here, at that action."""
    for action_id in action_ids:
        result = checked_step(env, env.step(action_id))
        yield result
        if result[2] or result[3]:  # terminated or truncated: the actions after it are not played
            return


def checked_action_id(env: Any, text: str, action_id: Any) -> int | None:
    """``parse_action(text)``'s result as an int or None, or :class:`EnvContractError`."""
    if action_id is None:
        return None
    if isinstance(action_id, bool) or not isinstance(action_id, numbers.Integral):
        raise EnvContractError(f"{_name(env)}.parse_action({text!r:.40}) returned {_a(action_id)}; "
                               "it returns an int action id or None")
    return int(action_id)


def describe_failure(method: str, exc: BaseException) -> str:
    """One line for an env call that failed: the contract's own sentence, else ``{method} raised {exc!r}``."""
    return str(exc) if isinstance(exc, EnvContractError) else f"{method} raised {exc!r}"
