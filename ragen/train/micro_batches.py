"""Micro-batches by token budget: how a mini-batch's rows are cut into forward/backward passes.

A micro-batch is padded to its longest row, so what its activations cost is ``rows × longest`` tokens, not its
row count. :func:`plan` cuts an ordered list of rows into consecutive micro-batches that each hold at most
``max_rows`` rows and at most ``max_tokens`` padded tokens (verl's dynamic batch size does the same with a token
budget per GPU). A bandit step's 100-token episodes then run 16 to a pass while a 20-turn FrozenLake episode of
1 100 tokens runs nearly alone, under one setting. Rows are not reordered: callers pass them longest first (or
grouped), so consecutive rows have similar lengths.

The gradient does not depend on the cut: each micro-batch's loss is weighted by its share of the whole
mini-batch's tokens (or sequences), so the accumulated gradient equals one pass over all rows up to float
summation order (``tests/train/test_micro_batches.py``).
"""

from __future__ import annotations

from typing import Sequence


def plan(lengths: Sequence[int], max_rows: int, max_tokens: int = 0) -> list[range]:
    """Consecutive micro-batches over rows ``0..len(lengths)-1``, in order.

    Each holds at most ``max_rows`` rows and, unless ``max_tokens`` is 0, at most ``max_tokens`` padded tokens
    (its row count times its longest row); a row longer than ``max_tokens`` runs alone. Greedy: a micro-batch
    takes rows until the next one would break a bound.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    batches: list[range] = []
    start, longest = 0, 0
    for row, length in enumerate(lengths):
        rows = row - start
        wider = max(longest, int(length))
        if rows and (rows + 1 > max_rows or (max_tokens and (rows + 1) * wider > max_tokens)):
            batches.append(range(start, row))
            start, wider = row, int(length)
        longest = wider
    if len(lengths) > start:
        batches.append(range(start, len(lengths)))
    return batches


def padded_tokens(lengths: Sequence[int], batches: list[range]) -> int:
    """Tokens the micro-batches run, padding included: Σ rows × longest row."""
    return sum(len(b) * max(int(lengths[i]) for i in b) for b in batches if len(b))
