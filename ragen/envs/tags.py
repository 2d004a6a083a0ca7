"""Env tags: named, reusable env variants (RAGEN's ``custom_envs``).

A tag is an env name plus its constructor config, an optional prompt override and its own
episode horizon (``max_turn``, ``max_actions_per_turn``, ``max_actions_per_traj``). Runs mix
tags in one training batch and validate on several (``es.train`` / ``es.val`` in the run
config; see ``docs/env_tags.md``). :data:`PRESET_TAGS` ships RAGEN's usual ones; a run YAML
adds tags, replaces presets or extends them under ``es.tags``.

This module knows envs and horizons only; the trainer turns a tag's horizon into the
agent's settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

#: RAGEN's usual tags. ``None`` horizon fields fall back to the run's ``agent`` section.
PRESET_TAGS: dict[str, dict[str, Any]] = {
    # 6x6, one box, up to 5 turns of 2 actions, 10 actions in all (RAGEN's main Sokoban setting).
    "SimpleSokoban": {
        "env": "sokoban",
        "config": {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 100},
        "max_turn": 5, "max_actions_per_turn": 2, "max_actions_per_traj": 10,
    },
    # 8x8 with two boxes: harder and longer; a generalisation target for SimpleSokoban.
    "LargerSokoban": {
        "env": "sokoban",
        "config": {"dim_room": [8, 8], "num_boxes": 2, "max_steps": 100, "search_depth": 10},
        "max_turn": 5, "max_actions_per_turn": 2, "max_actions_per_traj": 10,
    },
    # SimpleSokoban rooms described as coordinate lists instead of a grid (a different vocabulary).
    "CoordSokoban": {
        "env": "sokoban",
        "config": {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 100, "observation_format": "coord"},
        "max_turn": 5, "max_actions_per_turn": 2, "max_actions_per_traj": 10,
    },
    # 4x4 lake, deterministic moves.
    "FrozenLake": {
        "env": "frozen_lake",
        "config": {"size": 4, "is_slippery": False},
        "max_turn": 5, "max_actions_per_turn": 2, "max_actions_per_traj": 10,
    },
    # 4x4 lake where a move goes the intended way with probability 1/3 (gymnasium's rule).
    "SlipperyFrozenLake": {
        "env": "frozen_lake",
        "config": {"size": 4, "is_slippery": True},
        "max_turn": 5, "max_actions_per_turn": 2, "max_actions_per_traj": 10,
    },
    # One pull; arm names from the training lists. The seed's parity sets which place the high arm is listed in, so
    # consecutive validation seeds are position-balanced: answering by position scores 0.5 (docs/main_job.md).
    "Bandit": {
        "env": "bandit",
        "config": {"name_set": "train", "arm_order": "seed_parity"},
        "max_turn": 1, "max_actions_per_turn": 1, "max_actions_per_traj": 1,
    },
    # One pull; arm names never seen in training (the generalisation test of RAGEN's Bandit).
    "BanditTest": {
        "env": "bandit",
        "config": {"name_set": "test", "arm_order": "seed_parity"},
        "max_turn": 1, "max_actions_per_turn": 1, "max_actions_per_traj": 1,
    },
    # One arithmetic expression per episode.
    "Countdown": {
        "env": "countdown",
        "config": {},
        "max_turn": 1, "max_actions_per_turn": 1, "max_actions_per_traj": 1,
    },
}

#: Keys a tag may hold (the schema's ``EnvTagConfig`` has the same ones).
TAG_KEYS = ("env", "config", "instructions", "system_prompt", "max_turn", "max_actions_per_turn", "max_actions_per_traj")


class TagError(ValueError):
    """An unknown tag, or a tag whose env or config is rejected; the message names the tag."""


@dataclass
class EnvTag:
    """One resolved tag."""

    name: str
    #: Registered env name.
    env: str
    config: dict[str, Any] = field(default_factory=dict)
    #: Replaces the env's own ``instructions`` in the first prompt ("" = keep the env's).
    instructions: str = ""
    #: Replaces the run's ``agent.system_prompt`` (None = keep it).
    system_prompt: str | None = None
    max_turn: int | None = None
    max_actions_per_turn: int | None = None
    max_actions_per_traj: int | None = None

    def make_env(self):
        """A fresh env of this tag (``ragen.envs.make(env, **config)``); TagError naming the tag if rejected."""
        import ragen.envs

        try:
            return ragen.envs.make(self.env, **self.config)
        except (ValueError, TypeError) as exc:
            raise TagError(f"env tag {self.name!r}: {exc}") from None
        except Exception as exc:  # a user env's constructor failing otherwise: one line naming the tag, not a traceback
            raise TagError(f"env tag {self.name!r}: building the env raised {exc!r}") from None

    def horizon(self) -> dict[str, Any]:
        """The agent-setting overrides this tag sets (fields left ``None`` are not included)."""
        keys = ("system_prompt", "max_turn", "max_actions_per_turn", "max_actions_per_traj")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.instructions:
            out["instructions"] = self.instructions
        return out


def tag_names(user_tags: Mapping[str, Any] | None = None) -> list[str]:
    """Every known tag: the presets and the run's own, sorted."""
    return sorted(set(PRESET_TAGS) | set(user_tags or {}))


def extend_preset(name: str, own: dict[str, Any]) -> dict[str, Any]:
    """A user tag without ``env`` named like a preset: the preset with ``own``'s settings on top.

    ``config`` keys are merged over the preset's config; every other field ``own`` sets (a non-empty
    ``instructions``, a non-None system prompt or horizon) replaces the preset's; a field left unset
    (None) keeps the preset's, so an extending tag cannot hand a preset's horizon back to the
    ``agent`` section (replace the preset whole for that).
    """
    merged = dict(PRESET_TAGS[name])
    merged["config"] = {**(merged.get("config") or {}), **(own.get("config") or {})}
    for key, value in own.items():
        # None (and "" instructions) is the schema's "not set"; a "" system prompt means no system message
        if key not in ("env", "config") and value is not None and not (key == "instructions" and value == ""):
            merged[key] = value
    return merged


def resolve_tag(name: str, user_tags: Mapping[str, Mapping[str, Any]] | None = None) -> EnvTag:
    """The tag called ``name``: the run's own definition (``es.tags``) wins over a preset.

    A user tag that names its ``env`` replaces the preset of the same name whole; one without ``env``
    named like a preset extends it (``es.tags.Bandit.config.own_payoff_draw=true`` keeps the preset
    Bandit's arm names, order and horizon and adds the key; :func:`extend_preset`).

    Checks the tag fully (its env exists and accepts the config, horizons are >= 1, or >= 0
    for ``max_actions_per_traj``) and raises :class:`TagError` naming the tag otherwise.
    """
    user_tags = user_tags or {}
    if not name or "/" in name or name != name.strip():
        raise TagError(f"env tag {name!r}: a tag name must be non-empty, without '/' or surrounding spaces")
    if name in user_tags:
        raw = dict(user_tags[name])
        if not raw.get("env") and name in PRESET_TAGS and not set(raw) - set(TAG_KEYS):
            raw = extend_preset(name, raw)
    elif name in PRESET_TAGS:
        raw = dict(PRESET_TAGS[name])
    else:
        raise TagError(f"unknown env tag {name!r}; known tags: {', '.join(tag_names(user_tags))} (define your own under es.tags)")
    unknown = sorted(set(raw) - set(TAG_KEYS))
    if unknown:
        raise TagError(f"env tag {name!r}: unknown key {unknown[0]!r}; a tag has {', '.join(TAG_KEYS)}")
    if not raw.get("env"):
        raise TagError(f"env tag {name!r}: 'env' (a registered env name) is required "
                       f"(only a tag named like a preset may leave it out, to extend that preset)")
    raw["config"] = dict(raw.get("config") or {})
    tag = EnvTag(name=name, **raw)
    for key in ("max_turn", "max_actions_per_turn"):
        value = getattr(tag, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TagError(f"env tag {name!r}: {key} must be an int >= 1, got {value!r}")
    traj = tag.max_actions_per_traj
    if traj is not None and (isinstance(traj, bool) or not isinstance(traj, int) or traj < 0):
        raise TagError(f"env tag {name!r}: max_actions_per_traj must be an int >= 0, got {tag.max_actions_per_traj!r}")
    tag.make_env()  # the env and its config are checked by the env itself
    return tag
