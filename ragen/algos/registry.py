"""Name → function registries for advantage estimators and policy losses.

The trainer selects algorithm variants by name (``get_adv_estimator(cfg.adv_estimator)``), so adding a
variant never means adding an ``if name == ...`` branch anywhere: decorate the function instead.

* Advantage estimators have the signature ``fn(inp: AdvantageInputs) -> AdvantageOutputs``.
* Policy losses have the signature
  ``fn(logprobs, old_logprobs, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c,
  loss_agg_mode) -> (loss scalar, metrics dict)``; all tensors are (B, T).
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

ADV_ESTIMATORS: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}


def _same_function(a: Callable, b: Callable) -> bool:
    """True if ``a`` and ``b`` are the same definition (tolerates a module being re-imported)."""
    key = lambda f: (getattr(f, "__module__", None), getattr(f, "__qualname__", None))  # noqa: E731
    return a is b or key(a) == key(b)


def _register(table: dict[str, Callable], kind: str, name: str) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        if name in table and not _same_function(table[name], fn):
            raise ValueError(f"{kind} {name!r} is already registered to {table[name]!r}")
        table[name] = fn
        return fn

    return decorator


def _lookup(table: dict[str, Callable], kind: str, name: str) -> Callable:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}")
    return table[name]


def register_adv_estimator(name: str) -> Callable[[F], F]:
    """Decorator: register ``fn(AdvantageInputs) -> AdvantageOutputs`` under ``name``."""
    return _register(ADV_ESTIMATORS, "advantage estimator", name)


def get_adv_estimator(name: str) -> Callable:
    """The advantage estimator registered as ``name``; ValueError listing the known names otherwise."""
    return _lookup(ADV_ESTIMATORS, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator: register a policy loss ``fn(logprobs, old_logprobs, advantages, mask, **kw)``."""
    return _register(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as ``name``; ValueError listing the known names otherwise."""
    return _lookup(POLICY_LOSSES, "policy loss", name)
