"""A 2-process gloo update equals the single-process update on the same global batch.

The ranks are forked (``torch.multiprocessing.start_processes(start_method="fork")``, the
same API as ``spawn``): a spawned child would re-import torch and transformers (~25 s each on
this machine), a forked one inherits the trainer built once here. They meet through a file
store in a fresh temp dir (no port to race for) and run the real ``ActorUpdate.optimizer_step``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ragen.config import load_config
from ragen.train.distributed import reduce_metrics, shard
from ragen.train.trainer import StarPOTrainer

from tests.train.distributed_helpers import (
    WORLD, _run_ranks, assert_adam_steps_close, assert_grads_close, synthetic_batch,
)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-run")
    config = load_config("sokoban", [
        "model=tiny", "trainer.precision=fp32", f"trainer.output_dir={out}", "trainer.progress_bar=false",
        "algorithm.micro_batch_size=2",  # accumulation inside each rank as well
        "optim.lr=1e-3", "algorithm.entropy_coeff=0.01",
    ])
    return StarPOTrainer(config)


def snapshot(trainer) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "grads": {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None},
    }


def _rank_step(rank, init_method, trainer, batch, targets, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        metrics = trainer.actor.optimizer_step(batch, targets)
        torch.save({**snapshot(trainer), "metrics": metrics}, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def single_step(trainer, batch, targets) -> tuple[dict, dict]:
    """The same step in this process, on a copy (the fixture's trainer stays at its initial weights)."""
    solo = copy.copy(trainer.actor)
    solo.model = copy.deepcopy(trainer.model)
    solo.optimizer = torch.optim.AdamW(
        [p for p in solo.model.parameters() if p.requires_grad], **{k: v for k, v in trainer.optimizer.defaults.items()
                                                                     if k in ("lr", "betas", "weight_decay", "eps")})
    solo.scheduler = torch.optim.lr_scheduler.LambdaLR(solo.optimizer, lambda step: 1.0)
    metrics = solo.optimizer_step(batch, targets)
    return snapshot(solo), metrics


def test_shard_is_contiguous_and_covers_every_row():
    for n in range(0, 9):
        for world in (1, 2, 3):
            parts = [shard(n, r, world) for r in range(world)]
            assert [i for p in parts for i in range(n)[p]] == list(range(n))
            sizes = [p.stop - p.start for p in parts]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        shard(4, 2, 2)
    assert reduce_metrics({"a": 1.0}) == {"a": 1.0}  # one process: identity


def test_two_gloo_ranks_match_one_process(trainer, tmp_path):
    batch, targets = synthetic_batch()
    _run_ranks(_rank_step, trainer, batch, targets, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    single, single_metrics = single_step(trainer, batch, targets)
    initial = {n: p.detach() for n, p in trainer.model.named_parameters()}

    for name in single["params"]:
        # ranks stay bit-identical to each other (same summed grads, same optimizer)
        torch.testing.assert_close(ranks[0]["params"][name], ranks[1]["params"][name], rtol=0, atol=0)
        # the equivalence proper: summed, token-weighted, clipped gradients equal the single-process ones
        assert_grads_close(ranks[0]["grads"][name], single["grads"][name])
        assert_adam_steps_close(ranks[0]["params"][name] - initial[name], single["params"][name] - initial[name],
                                single["grads"][name], lr=1e-3)
    moved = sum(float((single["params"][n] - initial[n]).abs().sum()) for n in initial)
    assert moved > 0
    for key in ("actor/loss", "actor/entropy", "actor/pg_loss", "actor/grad_norm"):
        if key in single_metrics:
            assert ranks[0]["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-4), key
            assert ranks[1]["metrics"][key] == ranks[0]["metrics"][key]


def test_averaging_per_rank_token_means_would_not_match(trainer, monkeypatch):
    """Why the ranks sum token-weighted gradients: DDP-style averaging of each rank's own
    token-mean is wrong when ranks hold unequal token counts (9 vs 25 here), so the test above
    would fail if the trainer averaged."""
    monkeypatch.setattr(trainer.config.optim, "grad_clip", 1e9)  # raw gradients, no rescaling
    batch, targets = synthetic_batch()
    full = single_step(trainer, batch, targets)[0]["grads"]
    parts, tokens = [], []
    for r in range(WORLD):
        rows = shard(len(batch), r, WORLD)
        parts.append(single_step(trainer, batch.select(rows), targets.select(rows))[0]["grads"])  # rank r's token-mean
        tokens.append(float(batch.response_mask[rows].sum()))
    assert tokens == [9.0, 25.0]
    weighted = {n: (tokens[0] * parts[0][n] + tokens[1] * parts[1][n]) / sum(tokens) for n in full}
    averaged = {n: (parts[0][n] + parts[1][n]) / 2 for n in full}
    for n in full:
        assert_grads_close(weighted[n], full[n])
    gap = max(float((averaged[n] - full[n]).abs().max() / full[n].abs().max().clamp(min=1e-12)) for n in full)
    assert gap > 0.05, gap  # averaging is far outside the tolerance the equivalence test uses


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_torchrun_train_matches_single_process(tmp_path, fsdp):
    """``torchrun --nproc_per_node=2 -m ragen train`` and ``ragen train`` give the same metrics and
    checkpoint (two steps, mini-batches of 4 of 6 rows, so ranks get unequal rows and tokens),
    with the replicated update and with ``trainer.fsdp=true``."""
    import json
    import os
    import subprocess
    import sys

    from ragen.cli import main
    from ragen.train.checkpoint import latest_checkpoint

    common = ["sokoban", "model=tiny", "trainer.total_steps=2", "rollout.env_groups=2", "rollout.group_size=3",
              "rollout.max_new_tokens=8", "agent.max_turn=2", "trainer.val_episodes=2", "trainer.progress_bar=false",
              "trainer.save_final=false", "trainer.save_freq=1", "algorithm.micro_batch_size=1", "trainer.precision=fp32",
              "algorithm.adv_estimator=gae", "algorithm.mini_batch_size=4", "optim.lr=1e-3", "trainer.plot=false",
              f"trainer.fsdp={str(fsdp).lower()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "-m", "ragen", "train", *common, f"trainer.output_dir={tmp_path / 'ddp'}"], env=env, check=True, timeout=600)
    assert main(["train", *common, f"trainer.output_dir={tmp_path / 'solo'}"]) == 0
    rows = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in ("ddp", "solo")]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == [0, 1, 2]
    # a critic (GAE) so the update has a gradient even when every return is the same format penalty (the untrained
    # tiny model rarely answers well-formed: with reinforce_pp every advantage was 0 and the update skipped its backward)
    assert rows[1][1]["actor/grad_norm"] > 0 and rows[1][2]["actor/grad_norm"] > 0
    unstable = {"critic/explained_variance"}  # 1 - Var(R - V) / Var(R) is 0/0 when every return is equal
    for ddp, solo in zip(*rows):
        assert {k for k in ddp if not k.startswith("time/")} == {k for k in solo if not k.startswith("time/")}
        for key in solo:
            if not key.startswith("time/") and key not in unstable:
                assert ddp[key] == pytest.approx(solo[key], rel=1e-4, abs=1e-6, nan_ok=True), key
    ckpts = [latest_checkpoint(tmp_path / run)[1]["params"] for run in ("ddp", "solo")]
    for name in ckpts[1]:
        # lr = 1e-3: a wrong gradient moves weights by ~lr per step; rounding near Adam's eps by far less
        torch.testing.assert_close(ckpts[0][name], ckpts[1][name], rtol=1e-4, atol=1e-4)
