"""Evaluation: validation on held-out seeds and episode metrics."""

from ragen.eval.metrics import episode_metrics

__all__ = ["episode_metrics"]
