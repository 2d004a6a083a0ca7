"""A run's training mix and validation sets as env tags, flattened to one slot per episode.

``es.train`` / ``es.val`` name tags (``ragen/envs/tags.py``); a run without them is the
one-tag case: the tag is named after ``env.name``, uses ``env.config`` and the ``agent``
section unchanged, ``rollout.env_groups`` groups and ``trainer.val_episodes`` validation
episodes. Each tag's :class:`AgentConfig` is the ``agent`` section with the tag's horizon
and prompt overrides on top.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import gymnasium as gym

from ragen.agent.settings import AgentConfig
from ragen.config import RunConfig, user_tag_dicts
from ragen.envs.tags import EnvTag, resolve_tag


#: Validation seeds are ``VAL_SEED_BASE + i``; training seeds are drawn below it, so the two never overlap.
VAL_SEED_BASE = 2**31


@dataclass
class TagSet:
    """One tag of the run with its agent settings and its count (groups to train, or episodes to validate)."""

    tag: EnvTag
    settings: AgentConfig
    count: int

    @property
    def name(self) -> str:
        return self.tag.name


@dataclass
class Slots:
    """Per-episode lists, index-aligned, as :meth:`ragen.agent.Rollout.run` takes them."""

    envs: list[gym.Env] = field(default_factory=list)
    env_names: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    settings: list[AgentConfig] = field(default_factory=list)

    @classmethod
    def build(cls, sets: list[TagSet], episodes_per_unit: int, start: int = 0, end: int | None = None) -> "Slots":
        """``set.count * episodes_per_unit`` fresh envs per tag set, in order (a group's envs are adjacent).

        ``start``/``end`` keep only the slots ``[start, end)`` of that sequence, and make only their envs
        (a Ray rollout worker's share).
        """
        slots, index = cls(), 0
        for s in sets:
            n = s.count * episodes_per_unit
            first, last = max(start, index), min(index + n, end if end is not None else index + n)
            k = max(0, last - first)
            slots.envs += [s.tag.make_env() for _ in range(k)]
            slots.env_names += [s.tag.env] * k
            slots.tags += [s.name] * k
            slots.settings += [s.settings] * k
            index += n
        return slots

    def __len__(self) -> int:
        return len(self.envs)


def tag_settings(config: RunConfig, tag: EnvTag) -> AgentConfig:
    """The ``agent`` section with ``tag``'s horizon and prompt overrides."""
    return AgentConfig(**{**asdict(config.agent), **tag.horizon()})


def _single_tag(config: RunConfig) -> EnvTag:
    return EnvTag(name=config.env.name, env=config.env.name, config=dict(config.env.config))


def train_sets(config: RunConfig) -> list[TagSet]:
    """The training mix: ``es.train`` entries, or the single ``env`` with ``rollout.env_groups`` groups."""
    if not config.es.train:
        tag = _single_tag(config)
        return [TagSet(tag, tag_settings(config, tag), config.rollout.env_groups)]
    user = user_tag_dicts(config)
    out = []
    for entry in config.es.train:
        tag = resolve_tag(entry.tag, user)
        out.append(TagSet(tag, tag_settings(config, tag), entry.groups))
    return out


def val_sets(config: RunConfig) -> list[TagSet]:
    """The validation sets: ``es.val`` entries, or every training tag with ``trainer.val_episodes`` episodes."""
    if not config.es.val:
        return [TagSet(s.tag, s.settings, config.trainer.val_episodes) for s in train_sets(config)]
    user = user_tag_dicts(config)
    out = []
    for entry in config.es.val:
        tag = resolve_tag(entry.tag, user)
        out.append(TagSet(tag, tag_settings(config, tag), entry.episodes or config.trainer.val_episodes))
    return out
