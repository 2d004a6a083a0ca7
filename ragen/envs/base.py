"""The contract every ragen environment follows.

A ragen env is a :class:`gymnasium.Env` whose observations are text. On top of
gymnasium's API it exposes what the agent layer needs to talk to a language
model, and nothing about models or tokens:

* ``instructions`` -- the task description shown once, before the first observation;
* ``action_lookup`` -- ``{action_id: action_name}``; may change on ``reset`` (Bandit);
* ``parse_action(text) -> int | None`` -- map one answer string to an action id;
* ``info`` from ``step`` always has ``success``, ``action_is_valid`` and
  ``action_is_effective``.

``step`` accepts an action id. Stepping with an id outside ``action_lookup``
is a programming error and raises ``ValueError``; the *agent* turns malformed model
text into a format penalty before it ever reaches the env.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dataclasses
import numbers

import gymnasium as gym
import numpy as np

#: ``step`` info keys with this prefix are an env's own per-turn numbers (``info["metric/<name>"]``): training and
#: validation log their mean per tag as ``info_<name>`` (:func:`ragen.eval.metrics.episode_metrics`).
ENV_METRIC_PREFIX = "metric/"

#: The rollout resets every env with ``options={GROUP_MEMBER_OPTION: j}``, ``j`` = 0, 1, ... its place in its group
#: (the envs of a group share a seed, so the start state). An env may use it to give each member its own draw of
#: the randomness after the start (:func:`after_start_rng`: Bandit's ``own_payoff_draw``, FrozenLake's
#: ``own_slip_draw``, 2048's ``own_spawn_draw``); envs without randomness after the start ignore it.
GROUP_MEMBER_OPTION = "group_member"


def group_member(options: dict | None, env_name: str) -> int:
    """The env's place in its group from ``reset``'s ``options`` (0 when absent); a clear ``ValueError`` otherwise."""
    member = (options or {}).get(GROUP_MEMBER_OPTION, 0)
    if isinstance(member, bool) or not isinstance(member, numbers.Integral) or member < 0:  # numpy ints too
        raise ValueError(f"{env_name}: options[{GROUP_MEMBER_OPTION!r}] must be an int >= 0, got {member!r}")
    return int(member)


#: The spawn key's first word for an env's own after-start generator (ASCII "RAGN"). ``default_rng([seed, member])``
#: would not do: numpy pads a seed's entropy with zeros, so member 0's stream would be ``np_random``'s own, the very
#: draws that built the start state (Bandit's arm names); ``np_random.spawn`` children use one-word keys ``(i,)``.
AFTER_START_KEY = 0x5241474E


def after_start_rng(env: gym.Env, seed: int | None, options: dict | None, own: bool, env_name: str) -> np.random.Generator:
    """The generator for what happens after the start (payoffs, slips, spawned tiles), chosen at ``reset``.

    ``env.np_random`` by default: the envs of a group share the seed, so they share these draws too (the same
    actions meet the same luck). With ``own`` and a seed, a generator seeded by
    ``SeedSequence(seed, spawn_key=(AFTER_START_KEY, member))``, ``member`` the env's place in its group
    (:func:`group_member`): each env of a group its own draws, independent of the start state's and of each
    other's, and still a function of ``(seed, member)``, so reproducible. Without a seed ``env.np_random`` is
    unseeded already. The option is validated either way, so a bad ``group_member`` is an error whether or not
    ``own`` is set.
    """
    member = group_member(options, env_name)
    if not own or seed is None:
        return env.np_random
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(AFTER_START_KEY, member)))


def field_default(field: dataclasses.Field) -> Any:
    """A config field's default value: ``default``, or a fresh ``default_factory()`` (``dataclasses.MISSING`` if none)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def check_config_value(key: str, value: Any, default: Any, env_name: str) -> None:
    """Raise a ``ValueError`` naming ``key`` when ``value`` does not have the type of the field's ``default``."""
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ValueError(f"{env_name}: config key {key!r} must be a bool, got {value!r}")
    if isinstance(default, int) and not isinstance(default, bool) and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{env_name}: config key {key!r} must be an int, got {value!r}")
    if isinstance(default, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{env_name}: config key {key!r} must be a number, got {value!r}")
    if isinstance(default, str) and not isinstance(value, str):
        raise ValueError(f"{env_name}: config key {key!r} must be a string, got {value!r}")
    if isinstance(default, (tuple, list)) and (isinstance(value, (str, bytes)) or not isinstance(value, Sequence)):
        raise ValueError(f"{env_name}: config key {key!r} must be a list (like {list(default)!r}), got {value!r}")


def build_config(config_cls: type, cfg: dict[str, Any], env_name: str):
    """Instantiate an env's ``Config`` dataclass from ``cfg``, naming any unknown key or wrong type.

    A value must have the type of its field's default (``default``, or what ``default_factory`` makes): a bool,
    an int, a number, a string or a list; fields without a default, or with a default of another type, are not
    checked here (the ``Config``'s own ``validate`` may).
    """
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for key, value in cfg.items():
        if key not in fields:
            raise ValueError(f"{env_name}: unknown config key {key!r}; known keys: {', '.join(fields)}")
        check_config_value(key, value, field_default(fields[key]), env_name)
    config = config_cls(**cfg)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


class TextEnv(gym.Env):
    """Base class for text-observation envs. Subclasses implement ``reset``/``step``."""

    #: Observations are text in every mode: ``render()`` returns the observation text for None, "text" and "ansi".
    metadata = {"render_modes": ["text", "ansi"]}
    #: One-line description shown by ``ragen envs``.
    description: str = ""
    instructions: str = ""
    action_lookup: dict[int, str] = {}
    #: The reward of a valid action that achieves nothing (Sokoban's step penalty; 0 where moving is free). A
    #: malformed turn costs ``agent.format_penalty`` plus this for every action the turn could have taken, so an
    #: unparsable answer never pays better than a well-formed useless one (else RL learns to answer malformed).
    idle_action_reward: float = 0.0

    def parse_action(self, text: str) -> int | None:
        """Return the action id named by ``text`` (case- and space-insensitive), else None."""
        key = " ".join(text.split()).lower()
        for action_id, name in self.action_lookup.items():
            if name.lower() == key:
                return action_id
        return None

    def check_action(self, action: Any) -> int:
        """Validate an action id for ``step``; raise a clear ``ValueError`` otherwise.

        An id is an integer (``int`` or a NumPy integer, as ``action_space.sample()`` gives); a bool, a float
        (``1.9``), a string (``"2"``) or anything else is refused rather than converted, as is an id outside
        ``action_lookup``.
        """
        if isinstance(action, (bool, np.bool_)) or not isinstance(action, numbers.Integral):
            raise ValueError(f"{type(self).__name__}: action must be an int id, got {type(action).__name__} {action!r:.60}")
        action_id = int(action)
        if action_id not in self.action_lookup:
            raise ValueError(
                f"{type(self).__name__}: invalid action id {action_id}; valid ids are {sorted(self.action_lookup)}"
            )
        return action_id

    def render(self) -> str:  # pragma: no cover - subclasses override
        raise NotImplementedError
