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


def test_fsdp_ranks_match_one_process(tmp_path):
    from ragen.train.checkpoint import latest_checkpoint

    _run_ranks(_fsdp_step, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    solo = make_trainer(tmp_path / "solo", STEP)  # one process: trainer.fsdp has no effect
    assert not solo.fsdp
    batch, targets = synthetic_batch()
    solo_metrics, solo_grads, _ = steps(solo, batch, targets)

    # sharded: every decoder layer's weights, each rank holding about half of each, still after a no-grad pass
    assert ranks[0]["layer_is_fsdp"] and ranks[0]["sharded"]
    assert all(".layers." in n for n in ranks[0]["sharded"])
    n_layer_params = sum(1 for n, _ in solo.model.named_parameters() if ".layers." in n)
    assert len(ranks[0]["sharded"]) == n_layer_params
    assert ranks[0]["layers_after_score"] == ["DTensor"] * n_layer_params
    solo_params = dict(solo.model.named_parameters())
    for name, numel in ranks[0]["local"].items():
        assert numel + ranks[1]["local"][name] == solo_params[name].numel()

    # clipping is active (grad_clip 1e-5 < the raw norm) and leaves gradients of norm grad_clip
    assert solo_metrics["actor/grad_norm"] > 1e-5
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in solo_grads.values()]))
    assert float(clipped) == pytest.approx(1e-5, rel=1e-3)
    for name, p in solo.model.named_parameters():
        torch.testing.assert_close(ranks[0]["initial"][name], ranks[1]["initial"][name], rtol=0, atol=0)
        assert_grads_close(ranks[0]["grads"][name], solo_grads[name])  # after clipping
        torch.testing.assert_close(ranks[0]["params"][name], ranks[1]["params"][name], rtol=0, atol=0)  # same model on both
        torch.testing.assert_close(ranks[0]["replica"][name], ranks[0]["params"][name], rtol=0, atol=0)
    for key in ("actor/loss", "actor/entropy", "actor/pg_loss", "actor/grad_norm"):
        if key in solo_metrics:
            assert ranks[0]["metrics"][key] == pytest.approx(solo_metrics[key], rel=1e-4), key
            assert ranks[1]["metrics"][key] == ranks[0]["metrics"][key]

    # after the zero-gradient step (weight decay and the moments still act on every weight) the
    # checkpoint rank 0 gathered equals one process's: weights and AdamW state
    ckpts = [latest_checkpoint(run)[1] for run in (tmp_path / "run", tmp_path / "solo")]
    assert set(ckpts[0]["params"]) == set(ckpts[1]["params"]) == set(solo_params)
    for kind in ("params", "optimizer_tensors"):
        assert set(ckpts[0][kind]) == set(ckpts[1][kind])
        for name, value in ckpts[1][kind].items():
            torch.testing.assert_close(ckpts[0][kind][name], value, rtol=1e-4, atol=1e-6)
    for name, p in solo.model.named_parameters():
        torch.testing.assert_close(ranks[0]["params"][name], p.detach(), rtol=1e-4, atol=1e-6)


def test_clipping_scales_the_gradients_in_one_process(tmp_path):
    """``optim.grad_clip`` is applied (the gradients AdamW sees have norm grad_clip), and the
    reported norm is the one before clipping."""
    solo = make_trainer(tmp_path / "solo", ["optim.grad_clip=1e-6"])
    batch, targets = synthetic_batch()
    metrics = solo.actor.optimizer_step(batch, targets)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in solo.actor.trainable_parameters()
                                                 if p.grad is not None]))
    assert metrics["actor/grad_norm"] > 1e-5
    assert float(norm) == pytest.approx(1e-6, rel=1e-3)


#: lr 1e-4, not OVERRIDES' 1e-3: at step 1 the KL loss's gradient is 0 up to rounding (policy = reference),
#: and Adam's first step moves every such element by about ±lr whatever its size, so rounding that differs
#: between 2 ranks and one process (the CPU's kernels decide how much) becomes a real weight difference. At
#: 1e-3 step 2's metrics differed by up to 10 % on an AVX-512 Xeon (not on an AVX2 EPYC; with use_kl_loss=false
#: they agreed there too); at 1e-4 they agree within the comparison's rel 1e-4 / abs 1e-5 (advantages that are
#: whitened near-constant returns, ~0, agree only through the abs term).
COMMON = ["optim.lr=1e-4", "trainer.total_steps=2", "rollout.env_groups=2", "rollout.group_size=3", "rollout.max_new_tokens=8",
          "agent.max_turn=2", "trainer.val_episodes=2", "trainer.save_freq=1", "trainer.save_final=true",
          "algorithm.adv_estimator=reinforce_pp", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=1"]


def _fsdp_train(rank, init_method, out_dir, extra, resume):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        StarPOTrainer(load_config("sokoban", [*OVERRIDES, *COMMON, *extra, f"trainer.output_dir={out_dir}"]),
                      resume=resume).train()
    finally:
        dist.destroy_process_group()


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra", [
    ["algorithm.adv_estimator=gae", "algorithm.use_kl_loss=true"],  # critic (whole) + a sharded KL reference copy
    ["lora.rank=4", "algorithm.use_kl_loss=true"],  # sharded layers with frozen base weights; reference = adapters off
    ["algorithm.adv_estimator=gae", "algorithm.use_kl_loss=true", "trainer.fsdp=false"],  # the replicated (DDP-style) update
    ["algorithm.fast_update=false", "algorithm.use_kl_loss=true"],  # plain transformers passes: no layout to agree on
], ids=["fsdp-full+critic+kl", "fsdp-lora+kl", "replicated-full+critic+kl", "fsdp-plain-update+kl"])
def test_fsdp_train_checkpoint_resume_match_one_process(tmp_path, extra):
    """`train()` on 2 ranks: the metrics, checkpoint and final weights of one process; then a resumed
    2-rank run (under FSDP restoring sharded weights and AdamW moments from the whole checkpoint)
    goes on exactly like the resumed single-process run."""
    from ragen.train.checkpoint import latest_checkpoint

    fsdp, solo = tmp_path / "fsdp", tmp_path / "solo"
    _run_ranks(_fsdp_train, fsdp, extra, False)
    StarPOTrainer(load_config("sokoban", [*OVERRIDES, *COMMON, *extra, f"trainer.output_dir={solo}"])).train()
    rows = [_metrics(fsdp), _metrics(solo)]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == [0, 1, 2]
    assert rows[1][1]["actor/grad_norm"] > 0 and rows[1][2]["actor/grad_norm"] > 0
    # (critic/explained_variance = 1 - Var(R - V) / Var(R) is 0/0 here: the untrained tiny model never
    # answers well-formed, every return is the same format penalty, Var(R) is rounding noise.)
    unstable = {"critic/explained_variance"}
    for a, b in zip(*rows):
        timeless = lambda row: {k for k in row if not k.startswith("time/") and k not in unstable}  # noqa: E731
        assert timeless(a) == timeless(b)  # (FSDP adds time/weight_sync_s: the replica's sync)
        for key in timeless(a):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5, nan_ok=True), key
    ckpts = [latest_checkpoint(run)[1] for run in (fsdp, solo)]
    assert set(ckpts[0]["params"]) == set(ckpts[1]["params"]) and set(ckpts[0]["optimizer_tensors"]) == set(ckpts[1]["optimizer_tensors"])
    # (one step at lr 1e-4 moves a weight by up to ~2e-4: atol 1e-5 sees a missed or doubled step;
    # the AdamW moments are gradient-sized, so they are compared relative to their own scale)
    for kind in ("params", "optimizer_tensors"):
        for name, value in ckpts[1][kind].items():
            scale = 1e-5 if kind == "params" else 1e-3 * float(value.abs().max()) + 1e-12
            torch.testing.assert_close(ckpts[0][kind][name], value, rtol=1e-5 if kind == "params" else 1e-3, atol=scale)
    final = [sorted(p.name for p in (run / "final").iterdir()) for run in (fsdp, solo)]
    assert final[0] == final[1]
    from safetensors.torch import load_file

    for weights in [name for name in final[0] if name.endswith(".safetensors")]:
        saved = [load_file(run / "final" / weights) for run in (fsdp, solo)]
        assert set(saved[0]) == set(saved[1])
        for name, value in saved[1].items():
            torch.testing.assert_close(saved[0][name], value, rtol=1e-5, atol=1e-5)

    # resume both to step 3 from their step-2 checkpoints
    more = ["trainer.total_steps=3"]
    _run_ranks(_fsdp_train, fsdp, [*extra, *more], True)
    StarPOTrainer(load_config("sokoban", [*OVERRIDES, *COMMON, *extra, *more, f"trainer.output_dir={solo}"]), resume=True).train()
    rows = [_metrics(fsdp), _metrics(solo)]
    assert [r["step"] for r in rows[0]] == [0, 1, 2, 3]
    for key in rows[1][3]:
        if not key.startswith("time/") and key not in unstable:
            assert rows[0][3][key] == pytest.approx(rows[1][3][key], rel=1e-4, abs=1e-5, nan_ok=True), key


def _fsdp_layouts(rank, init_method, out_dir):
    """Each rank's own layout choice forced (rank 0 would pack, rank 1 would split), then both packing."""
    import ragen.train.actor_update as update_module
    import ragen.train.logprobs as logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        trainer = make_trainer(out_dir / "run")
        taken = []
        shipped = update_module.policy_forward
        update_module.policy_forward = lambda *a, **kw: taken.append(kw["prompt_layout"]) or shipped(*a, **kw)
        batch, targets = synthetic_batch()
        logprobs.packed_is_cheaper = lambda *a: rank == 0
        trainer.actor.optimizer_step(batch, targets)
        disagreeing, taken[:] = list(taken), []
        logprobs.packed_is_cheaper = lambda *a: True
        trainer.actor.optimizer_step(batch, targets)
        torch.save({"disagreeing": disagreeing, "agreeing": list(taken)}, out_dir / f"layouts{rank}.pt")
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


def test_the_plain_update_path_runs_full_rows_with_no_layout_to_agree_on(tmp_path, monkeypatch):
    """``algorithm.fast_update=false`` shares no prompts, so an FSDP update has one layout and joins no collective
    to pick it; the fast path under FSDP still asks every rank."""
    import ragen.train.actor_update as update_module

    batch, _ = synthetic_batch()
    asked = []
    monkeypatch.setattr(update_module, "all_ranks", lambda flag: asked.append(flag) or flag)
    plain = make_trainer(tmp_path / "plain", ["algorithm.fast_update=false"]).actor
    plain.fsdp = True
    assert plain.prompt_lengths(batch) is None and plain.agreed_layout(batch, None) == "auto" and not asked
    fast = make_trainer(tmp_path / "fast").actor
    fast.fsdp = True
    shared = fast.prompt_lengths(batch)
    assert shared is not None and fast.agreed_layout(batch, shared) in ("packed", "split") and len(asked) == 1
