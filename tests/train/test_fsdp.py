"""``trainer.fsdp=true``: 2 gloo ranks with FSDP-sharded decoder layers give the single-process update.

Like ``test_distributed.py`` the ranks are forked; here each rank builds its own
``StarPOTrainer`` after joining the process group, so the real ``__init__`` path shards the
model (sharding needs the group). The tiny model is seeded, so every trainer starts from the
same weights.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ragen.config import load_config
from ragen.models.freeze import decoder_layers
from ragen.train.distributed import shard
from ragen.train.fsdp import full_tensor
from ragen.train.trainer import StarPOTrainer
from tests.train.distributed_helpers import (
    WORLD, _run_ranks, assert_grads_close, synthetic_batch,
)

OVERRIDES = [
    "model=tiny", "trainer.precision=fp32", "trainer.progress_bar=false", "trainer.plot=false",
    "algorithm.micro_batch_size=2",  # rank 0 gets 3 rows (2 micro-batches), rank 1 gets 2 (1 + 1 padding pass)
    "optim.lr=1e-3", "algorithm.entropy_coeff=0.01", "trainer.fsdp=true",
]
#: A missing collective on one rank would otherwise hang for gloo's default 30 minutes.
TIMEOUT = timedelta(seconds=180)
#: Step test only: clipping active (the tiny model's gradient norm is ~7e-5) and weight decay, so a
#: step on exactly-zero gradients still moves every weight.
STEP = ["optim.grad_clip=1e-5", "optim.weight_decay=0.1"]


def make_trainer(out, extra=()):
    return StarPOTrainer(load_config("sokoban", [*OVERRIDES, f"trainer.output_dir={out}", *extra]))


def steps(trainer, batch, targets):
    """A normal step, a no-grad scoring pass, a step on exactly-zero gradients (the zero-advantage
    shortcut), then a checkpoint: what the trainer does with saturated rewards and save_freq."""
    metrics = trainer.actor.optimizer_step(batch, targets)
    grads = {n: full_tensor(p.grad.detach()).clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.actor.score(batch, policy=True, values=False, ref=False)
    layers_after_score = [type(p).__name__ for n, p in trainer.model.named_parameters() if ".layers." in n]
    trainer.actor.optimizer_step(batch, targets, zero_gradient=True)
    trainer.save_checkpoint(2)
    return metrics, grads, layers_after_score


def _fsdp_step(rank, init_method, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        trainer = make_trainer(out_dir / "run", STEP)
        layer = decoder_layers(trainer.model)[0]
        sharded = [n for n, p in trainer.model.named_parameters() if type(p).__name__ == "DTensor"]
        local = {n: p.to_local().numel() for n, p in trainer.model.named_parameters() if type(p).__name__ == "DTensor"}
        initial = {n: full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters()}
        batch, targets = synthetic_batch()
        metrics, grads, layers_after_score = steps(trainer, batch, targets)
        params = {n: full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters()}
        assert trainer.sync_rollout_weights()  # a collective: every rank joins; rank 0's replica follows the weights
        replica = {n: p.detach().clone() for n, p in trainer.rollout_model.named_parameters()} if rank == 0 else None
        assert (trainer.rollout_model is None) == (rank != 0)
        torch.save({"params": params, "grads": grads, "initial": initial, "metrics": metrics,
                    "sharded": sharded, "local": local, "layer_is_fsdp": hasattr(layer, "unshard"), "replica": replica,
                    "layers_after_score": layers_after_score}, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp_ranks_agree_on_the_shared_prompt_layout(tmp_path):
    """The packed layout runs one decoder pass where the split one runs two, and every pass of a sharded layer
    is a collective: a rank whose micro-batch would pack must split when another rank's would not (else
    the ranks' all-gathers pair up wrongly and hang). Both ranks pack only when both would."""
    _run_ranks(_fsdp_layouts, tmp_path)
    layouts = [torch.load(tmp_path / f"layouts{r}.pt") for r in range(WORLD)]
    rows = len(synthetic_batch()[0])
    passes = -(-max(len(range(rows)[shard(rows, r, WORLD)]) for r in range(WORLD)) // 2)  # micro-batches of 2 rows
    for r in range(WORLD):
        assert layouts[r]["disagreeing"] == ["split"] * passes
        assert layouts[r]["agreeing"] == ["packed"] * passes
