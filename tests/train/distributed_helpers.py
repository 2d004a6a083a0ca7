"""What the distributed tests share (not a test module): a synthetic global batch whose ranks hold
unequal token counts, the tolerances a multi-rank update is held to, and forking ``WORLD`` gloo ranks."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ragen.train.batch import TrainBatch
from ragen.train.update_targets import UpdateTargets

WORLD = 2
#: Rows: (prompt id, prompt length, response length). Rank 0 gets rows 0-2 (short answers),
#: rank 1 rows 3-4 (long answers): 3 + 4 + 2 = 9 tokens against 14 + 11 = 25.
ROWS = [(0, 6, 3), (0, 6, 4), (1, 5, 2), (1, 5, 14), (2, 7, 11)]


def synthetic_batch() -> tuple[TrainBatch, UpdateTargets]:
    g = torch.Generator().manual_seed(0)
    prompts = {p: torch.randint(3, 2000, (n,), generator=g) for p, n, _ in ROWS}
    B, L = len(ROWS), max(n + r for _, n, r in ROWS)
    input_ids = torch.full((B, L), 2, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, L - 1))
    for b, (p, n, r) in enumerate(ROWS):
        input_ids[b, :n] = prompts[p]
        input_ids[b, n : n + r] = torch.randint(3, 2000, (r,), generator=g)
        attention_mask[b, : n + r] = 1
        response_mask[b, n - 1 : n + r - 1] = 1  # target t scores token t + 1
    zeros = torch.zeros((B, L - 1))
    batch = TrainBatch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, token_rewards=zeros,
        turn_rewards=zeros, turn_ends=zeros.bool(), group_ids=torch.tensor([p for p, _, _ in ROWS]),
        scores=torch.zeros(B), anchor_ids=torch.full((B, L - 1), -1), step_returns=zeros,
    )
    advantages = torch.randn((B, L - 1), generator=g) * response_mask
    return batch, UpdateTargets(advantages=advantages, returns=zeros.clone())


def assert_grads_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Gradients equal up to fp32 summation order. The absolute tolerance is scaled to the tensor's
    largest entry: entries that are sums of cancelling terms carry rounding of the terms' size
    (2.3e-7 absolute seen on another CPU, in a tensor whose largest entry is 0.077), which no
    fixed atol fits on every machine. Averaging instead of summing is off by > 5 % of that entry."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=max(1e-5 * scale, 1e-12))


def assert_adam_steps_close(actual: torch.Tensor, expected: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
    """Adam's first step moves each weight by ~lr * g / (|g| + eps): a sign, except where |g| is near
    eps (1e-8), where summation-order rounding of g legitimately moves the step anywhere in
    [-lr, lr]. So: entries with |g| well above eps must match tightly (a wrong gradient flips
    signs, a 2 * lr difference); the rest only have to stay within one lr step."""
    sure = grad.abs() > 1e-6
    torch.testing.assert_close(actual[sure], expected[sure], rtol=1e-3, atol=1e-6)
    assert float((actual - expected).abs().max()) <= 2 * lr * 1.01


def _run_ranks(fn, *args) -> None:
    """``fn(rank, init_method, *args)`` in ``WORLD`` forked ranks. They meet through a file store in a fresh temp dir,
    not a TCP port: a port found free and then released can be taken by a parallel test (xdist) before rank 0 binds it."""
    with tempfile.TemporaryDirectory(prefix="ragen-dist-") as tmp:
        init_method = (Path(tmp) / "store").as_uri()
        mp.start_processes(fn, args=(init_method, *args), nprocs=WORLD, start_method="fork", join=True)
