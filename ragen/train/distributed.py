"""Data-parallel update stage over ``torch.distributed`` (launched by ``torchrun``).

What is split, and what is not
------------------------------
* The **rollout** is not split: rank 0 plays every env group and broadcasts the trajectories
  (:func:`broadcast_object`), so every rank holds the identical global batch and no rank's
  sampling RNG has to stay in lock-step with another's.
* **Advantages** (and π_old / reference / value scoring) are computed by every rank on the
  full global batch, *before* sharding. Group-relative estimators (GRPO, GiGPO, …) therefore
  always see whole groups, and sharding *rows* afterwards cannot split a group's statistics.
* The **update** is split: each optimizer step's mini-batch rows are cut into ``world``
  contiguous slices (:func:`shard`); each rank runs forward/backward on its slice only.

Exact equivalence with one process
----------------------------------
The single-process loss of a mini-batch is a token mean over all of its response tokens (or
a mean over its sequences for the ``seq-mean-*`` modes), accumulated over micro-batches with
weight ``micro tokens / mini-batch tokens``. Each rank keeps that *global* denominator (every
rank holds the whole mini-batch, so it is known without communication), so its gradient is
its slice's share of the global loss; :func:`all_reduce_grads` then **sums** the ranks'
gradients. The sum equals the single-process gradient up to float summation order.

Averaging instead (what ``DistributedDataParallel`` does: local token-mean per rank, then
mean over ranks) weights every rank equally whatever its token count, and differs from the
single-process update whenever ranks hold unequal numbers of tokens — always, with
variable-length responses. ``tests/train/test_distributed.py`` checks both facts.

Why an explicit all-reduce and not DDP: DDP would average (see above; undoing it needs a
``world`` rescale plus a comm hook), it wraps the module (renaming parameters that
checkpoints, LoRA and ``save_pretrained`` rely on), and it reduces during backward of each
micro-batch unless ``no_sync`` is threaded through the accumulation loop. One flattened
all-reduce per optimizer step, after the last micro-batch, is simpler and communicates the
same bytes. Gradient clipping and the optimizer then run on identical summed gradients on
every rank, so parameters stay identical without a broadcast.

With ``WORLD_SIZE`` unset or 1 everything here is a no-op and nothing is imported from
``torch.distributed`` beyond availability checks.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ragen.train.fsdp import is_sharded


def init_distributed(timeout_s: float = 3600.0) -> tuple[int, int]:
    """Join the process group ``torchrun`` describes (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``); return ``(rank, world)``.

    Backend: gloo on CPU; with CUDA, ``cpu:gloo,cuda:nccl`` (NCCL for CUDA tensors, gloo for
    the CPU tensors and pickled objects), and ``LOCAL_RANK``'s GPU becomes the current device
    when it is visible (a rank past the visible GPUs is left to ``trainer.device``). No-op returning ``(0, 1)`` when ``WORLD_SIZE`` is
    unset or 1. Idempotent: an already initialised group is reused. ``timeout_s`` is generous
    because ranks other than 0 wait at the broadcast while rank 0 rolls out and validates.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # Only a GPU that exists: with trainer.device=cpu a rank may have none, and with auto
        # resolve_device reports a missing one as a config error naming trainer.device.
        if local_rank < torch.cuda.device_count():
            torch.cuda.set_device(local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))  # env:// (MASTER_ADDR/PORT, RANK)
    return dist.get_rank(), dist.get_world_size()


def rank_world() -> tuple[int, int]:
    """``(rank, world)`` of the current process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """True on rank 0 (and in a single process): the only rank that writes run-dir files."""
    return rank_world()[0] == 0


def shard(n: int, rank: int, world: int) -> slice:
    """Rows ``[lo, hi)`` of an ``n``-row batch for ``rank``: a **contiguous** split, sizes differing by at most 1.

    Contiguous (like ``numpy.array_split``) rather than strided because the trainer already
    shuffles rows into mini-batches (``torch.randperm``), so slices are random anyway, and a
    slice keeps ``TrainBatch.select`` a view. A rank may get 0 rows when ``n < world``; it
    still joins the gradient all-reduce with zeros.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return slice(lo, lo + base + (1 if rank < extra else 0))


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over ranks, in place (missing grads count as zeros). No-op in one process.

    SUM, not mean: each rank's loss is already weighted by its share of the *global* tokens
    (see the module docstring). Gradients are flattened per dtype/device into one buffer.
    FSDP-sharded parameters (``trainer.fsdp``) are skipped: FSDP sums their gradients itself.
    """
    if rank_world()[1] == 1:
        return
    params = [p for p in params if not is_sharded(p)]  # FSDP shards: already summed by their reduce-scatter
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def reduce_metrics(metrics: dict[str, float], op: str = "sum") -> dict[str, float]:
    """Reduce scalar metrics over ranks: ``"sum"`` (for already share-weighted values), ``"mean"`` or ``"max"``.

    Keys missing on some ranks (e.g. a rank with an empty shard) count as 0 for ``sum``/``mean``
    and are skipped by ``max``. No-op in one process.
    """
    rank, world = rank_world()
    if world == 1:
        return dict(metrics)
    if op not in ("sum", "mean", "max"):
        raise ValueError(f"unknown reduce op {op!r}")
    keys: set[str] = set()
    for src in range(world):  # union of keys; world is small, and broadcasts on CPU work under any backend
        keys |= set(broadcast_object(sorted(metrics) if src == rank else None, src=src))
    names = sorted(keys)
    fill = float("-inf") if op == "max" else 0.0
    values = torch.tensor([float(metrics.get(k, fill)) for k in names], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    if op == "mean":
        values /= world
    return dict(zip(names, values.tolist()))


def all_ranks(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on every rank (a MIN all-reduce); ``flag`` in one process."""
    if rank_world()[1] == 1:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def broadcast_object(obj, src: int = 0):
    """``obj`` from rank ``src`` on every rank (pickled, through CPU). Identity in one process."""
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=torch.device("cpu"))
    return box[0]


def barrier() -> None:
    if rank_world()[1] > 1:
        dist.barrier()


def close_distributed() -> None:
    """Leave the process group (torchrun runs end cleanly without a destroy warning)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
