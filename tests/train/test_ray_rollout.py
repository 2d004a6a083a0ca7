"""Ray rollout workers (``rollout.backend=ray``): same trajectories as a local rollout, worker faults, a real run.

One local Ray session serves the whole module (starting Ray costs seconds); the trainers
built here find it running and reuse it.
"""

import dataclasses
import json
import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ragen.cli import main  # noqa: E402
from ragen.config import load_config  # noqa: E402
from ragen.train.ray_rollout import build_slots, init_ray, partition, split_evenly, worker_seed  # noqa: E402
from ragen.train.trainer import StarPOTrainer  # noqa: E402

# 3 groups of 2 over 2 workers: unequal slices (2 groups | 1 group), 2-turn Sokoban episodes.
BASE = ["model=tiny", "rollout.env_groups=3", "rollout.group_size=2", "rollout.max_new_tokens=8", "agent.max_turn=2",
        "trainer.val_episodes=2", "trainer.progress_bar=false", "trainer.precision=fp32"]


@pytest.fixture(scope="module")
def ray_session():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = init_ray(num_cpus=4)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_trainer(ray_session, tmp_path_factory):
    """One trainer with 2 Ray workers for the module (starting actors costs seconds each)."""
    trainer = _trainer(tmp_path_factory.mktemp("ray"), "ray")
    yield trainer
    trainer.close_rollout_pool()


def _trainer(tmp_path, backend, *extra):
    config = load_config("sokoban", [*BASE, f"rollout.backend={backend}", "rollout.num_workers=2",
                                     f"trainer.output_dir={tmp_path / backend}", *extra])
    return StarPOTrainer(config)


def _rollout(trainer, step, greedy=True):
    trainer.seed_rng = np.random.default_rng(trainer.config.seed)  # the same seeds on every call
    # greedy: validation's do_sample=False path, the same tokens whatever the RNG
    trainer.train_rollout.sampling = dataclasses.replace(trainer.train_rollout.sampling, do_sample=not greedy)
    return trainer.rollout(step)


def _key(t):
    return (t.group_id, t.seed, t.tag, t.input_ids, t.loss_mask, t.reward, [turn.response for turn in t.turns], t.error)


def test_partition_is_contiguous_and_group_aligned():
    assert partition(3, 2, 2) == [(0, 4), (4, 6)]
    assert partition(5, 4, 3) == [(0, 8), (8, 16), (16, 20)]
    assert partition(2, 3, 5) == [(0, 3), (3, 6)]  # never a worker without a group
    for groups, size, workers in [(7, 4, 3), (1, 1, 1), (8, 2, 8), (9, 1, 4)]:
        ranges = partition(groups, size, workers)
        assert ranges[0][0] == 0 and ranges[-1][1] == groups * size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all((end - start) % size == 0 and end > start for start, end in ranges)
    assert len({worker_seed(0, s, i) for s in range(3) for i in range(3)}) == 9
    assert worker_seed(0, 1, 0, "val") != worker_seed(0, 1, 0)  # validation has its own stream


def test_split_evenly_covers_every_validation_slot_once():
    assert split_evenly(3, 2) == [(0, 2), (2, 3)]
    assert split_evenly(1, 3) == [(0, 1), (1, 1), (1, 1)]  # workers without a validation episode
    for n, parts in [(0, 2), (7, 3), (64, 5)]:
        ranges = split_evenly(n, parts)
        assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_worker_slots_are_a_slice_of_the_trainers_slots():
    config = load_config("bandit", ["model=tiny", "rollout.env_groups=3", "rollout.group_size=2"])
    part = build_slots(config, 2, 6)
    assert len(part) == 4 and part.env_names == ["bandit"] * 4


def test_ray_rollout_equals_local_rollout_greedy(ray_trainer, tmp_path):
    local = _trainer(tmp_path, "local")
    local.model.load_state_dict(ray_trainer.model.state_dict())  # whatever another test did to the ray trainer's weights
    pool = ray_trainer.rollout_pool
    assert len(pool.workers) == 2 and pool.ranges == [(0, 4), (4, 6)]  # 2 groups | 1 group
    remote, expected = _rollout(ray_trainer, 1), _rollout(local, 1)
    assert len(remote) == len(expected) == 6
    assert [t.group_id for t in remote] == [0, 0, 1, 1, 2, 2]
    assert len({t.seed for t in remote}) == 3  # three groups, three start states
    assert any(t.response_length > 0 for t in remote)
    for a, b in zip(expected, remote):
        assert _key(a) == _key(b)


def test_validation_on_ray_workers_equals_local_validation_greedy(ray_trainer, tmp_path):
    local = _trainer(tmp_path, "local")
    local.model.load_state_dict(ray_trainer.model.state_dict())
    saved = ray_trainer.val_rollout.sampling
    try:
        for trainer in (ray_trainer, local):  # greedy: the same tokens whatever the sampling stream
            trainer.val_rollout.sampling = dataclasses.replace(saved, do_sample=False)
        assert ray_trainer.rollout_pool.val_ranges == [(0, 1), (1, 2)]  # one validation episode per worker
        remote, expected = ray_trainer.validation_trajectories(4), local.validation_trajectories(4)
        assert [t.seed for t in remote] == [2**31, 2**31 + 1]  # the held-out seeds, in order
        assert [_key(t) for t in remote] == [_key(t) for t in expected]
        assert ray_trainer.validate(4) == local.validate(4)
    finally:
        ray_trainer.val_rollout.sampling = saved


def test_ray_workers_get_the_trained_weights(ray_trainer, tmp_path):
    """After the trainer's weights change, the replicas generate what the trainer's own model does."""
    import torch

    local = _trainer(tmp_path, "local")
    before = _rollout(local, 1)
    saved = {n: p.detach().clone() for n, p in ray_trainer.model.named_parameters()}
    try:
        with torch.no_grad():
            for (n, p), (_, q) in zip(ray_trainer.model.named_parameters(), local.model.named_parameters()):
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
                q.copy_(p)
        moved = _rollout(ray_trainer, 1)
        assert [_key(t) for t in moved] == [_key(t) for t in _rollout(local, 1)]
        assert [_key(t) for t in moved] != [_key(t) for t in before]
    finally:
        with torch.no_grad():
            for n, p in ray_trainer.model.named_parameters():
                p.copy_(saved[n])


def test_dead_worker_is_replaced_and_its_slice_replayed(ray_trainer):
    trainer, pool = ray_trainer, ray_trainer.rollout_pool
    restarts = pool.restarts
    # sampled, not greedy: each worker is seeded from (step, worker index), so a replayed slice matches
    reference = _rollout(trainer, 3, greedy=False)
    assert len(reference) == 6 and pool.restarts == restarts

    # In one step, worker 1 is killed before its slice is submitted and worker 0 while its slice
    # is in flight: both are replaced (concurrently) and both slices replayed.
    old = list(pool.workers)
    ray.kill(pool.workers[1])
    submit = pool._submit

    def kill_after_submit(index, *args):
        future = submit(index, *args)
        if index == 0 and pool.workers[0] == old[0]:
            ray.kill(pool.workers[0])
        return future

    pool._submit = kill_after_submit
    try:
        again = _rollout(trainer, 3, greedy=False)
    finally:
        del pool._submit
    assert [_key(t) for t in again] == [_key(t) for t in reference]  # all six, in order, each once
    assert [t.group_id for t in again] == [0, 0, 1, 1, 2, 2]
    assert pool.restarts == restarts + 2
    assert all(new != dead for new, dead in zip(pool.workers, old))
    assert all(ray.get([w.ping.remote() for w in pool.workers]))  # live replacements
    assert [_key(t) for t in _rollout(trainer, 3, greedy=False)] == [_key(t) for t in reference]


def test_ragen_train_with_ray_workers(ray_session, tmp_path):
    small = ["model=tiny", "trainer.total_steps=2", "rollout.env_groups=2", "rollout.group_size=2",
             "rollout.max_new_tokens=6", "agent.max_turn=2", "trainer.val_episodes=2", "trainer.progress_bar=false",
             "trainer.val_before_train=false", "trainer.save_final=false"]
    # LoRA: the worker receives only the adapters (their names must match the replica's). One worker: each costs
    # ~10 s of CPU to start (importing transformers), and the module's trainer above runs two.
    assert main(["train", "sokoban", "rollout.backend=ray", "rollout.num_workers=1", "lora.rank=4",
                 f"trainer.output_dir={tmp_path}", *small]) == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all("actor/grad_norm" in line and "train/reward_mean" in line for line in lines)
    assert "val/success" in lines[-1]
    assert ray.is_initialized()  # the module's session: the trainer did not shut down what it did not start
