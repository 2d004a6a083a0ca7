"""Name → env-class registry. ``ragen.envs.register`` lets user code add envs without editing ragen."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import gymnasium as gym

from ragen.envs.base import field_default
from ragen.envs.contract import interface_problem

_REGISTRY: dict[str, Callable[..., gym.Env]] = {}


def register(name: str, factory: Callable[..., gym.Env] | None = None):
    """Register ``factory`` (usually an env class) under ``name``. Usable as a decorator."""

    def _add(f: Callable[..., gym.Env]):
        if name in _REGISTRY and _REGISTRY[name] is not f:
            raise ValueError(f"env name {name!r} is already registered to {_REGISTRY[name]!r}")
        _REGISTRY[name] = f
        return f

    return _add(factory) if factory is not None else _add


def make(name: str, **cfg: Any) -> gym.Env:
    """Build the env registered as ``name`` with keyword config ``cfg``; ``TypeError`` if it lacks what the agent layer
    calls besides gymnasium's API (:func:`ragen.envs.contract.interface_problem`: ``parse_action``)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown env {name!r}; registered envs: {', '.join(sorted(_REGISTRY))}")
    env = _REGISTRY[name](**cfg)
    problem = interface_problem(env)
    if problem:
        raise TypeError(f"env {name!r}: {problem}")
    return env


def registered() -> dict[str, Callable[..., gym.Env]]:
    return dict(_REGISTRY)


def env_config_fields(name: str) -> dict[str, Any]:
    """Config knobs of env ``name`` with defaults, read from its ``Config`` dataclass if it has one.

    A field with a ``default_factory`` shows what the factory makes (``dataclasses.MISSING`` for a field without
    a default)."""
    cls = _REGISTRY[name]
    config_cls = getattr(cls, "Config", None)
    if config_cls is None or not dataclasses.is_dataclass(config_cls):
        return {}
    return {f.name: field_default(f) for f in dataclasses.fields(config_cls)}


def habit_metric_names() -> tuple[str, ...]:
    """Names of the ``metric/<name>`` values that registered envs declare as habit metrics (``habit_metrics``, a class
    attribute): a policy that ignores its input pins such a share to 0 or 1 (Bandit's ``second_listed``: always the
    same listed position). :class:`ragen.eval.collapse.CollapseMonitor` watches them."""
    names: list[str] = []
    for factory in _REGISTRY.values():
        names += [n for n in getattr(factory, "habit_metrics", ()) if n not in names]
    return tuple(names)
