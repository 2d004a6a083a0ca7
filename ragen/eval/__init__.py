"""Evaluation: validation on held-out seeds and episode metrics (``ragen eval``: :mod:`ragen.eval.evaluate`)."""

from ragen.eval.evaluate import evaluate, format_table, pass_at_k, validation_seeds
from ragen.eval.metrics import episode_metrics

__all__ = ["episode_metrics", "evaluate", "format_table", "pass_at_k", "validation_seeds"]
