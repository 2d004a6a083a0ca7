"""The scale-out code's set-up and failure paths (torchrun set-up, Ray rollout pool).

Unit-level only (no torchrun, no real Ray): the collectives and the Ray API are faked where a test needs them.
"""

from __future__ import annotations

import types

import pytest
import torch

from ragen.config import load_config
from ragen.models.device import resolve_device
from ragen.train import distributed, ray_rollout


def _fake_torchrun_rank(monkeypatch, *, local_rank: int, gpus: int) -> dict:
    """One torchrun rank (``WORLD_SIZE=2``) on a machine whose torch sees ``gpus`` GPUs; records what
    ``init_distributed`` asks of CUDA and of the process group. ``set_device`` fails like torch's on a
    GPU that does not exist (``CUDA error: invalid device ordinal``)."""
    calls: dict = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    def set_device(index):
        if index >= gpus:
            raise RuntimeError("CUDA error: invalid device ordinal")
        calls["set_device"] = index

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: calls.update(backend=kw["backend"]))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: local_rank)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    return calls


def test_init_distributed_on_a_rank_without_its_own_gpu_leaves_the_device_to_trainer_device(monkeypatch):
    """``torchrun --nproc_per_node=2`` on a machine with one GPU: rank 1 has no ``cuda:1``. With
    ``trainer.device=cpu`` the run must start; with ``auto`` the rank must get resolve_device's one-line
    config error naming ``trainer.device`` (exit 2), not a raw CUDA error from inside init_distributed."""
    calls = _fake_torchrun_rank(monkeypatch, local_rank=1, gpus=1)
    assert distributed.init_distributed() == (1, 2)
    assert "set_device" not in calls
    assert calls["backend"] == "cpu:gloo,cuda:nccl"
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="trainer.device.*only 1 CUDA GPU"):
        resolve_device("auto")


def test_init_distributed_still_selects_local_rank_gpu(monkeypatch):
    calls = _fake_torchrun_rank(monkeypatch, local_rank=1, gpus=2)
    assert distributed.init_distributed() == (1, 2)
    assert calls == {"set_device": 1, "backend": "cpu:gloo,cuda:nccl"}
    calls = _fake_torchrun_rank(monkeypatch, local_rank=0, gpus=0)
    assert distributed.init_distributed() == (0, 2)
    assert calls == {"backend": "gloo"}


class _FakeRay:
    """The slice of the Ray API :class:`RayRolloutPool` uses; a worker's constructor fails at ``ping``."""

    class RayActorError(Exception):
        pass

    def __init__(self):
        self.exceptions = types.SimpleNamespace(RayActorError=self.RayActorError)
        self.initialized = True
        self.killed: list = []
        self.spawned: list = []

    def remote(self, **_options):
        fake = self

        class ActorClass:
            @staticmethod
            def remote(*args):
                handle = types.SimpleNamespace(ping=types.SimpleNamespace(remote=lambda: "ping-ref"), args=args)
                fake.spawned.append(handle)
                return handle

        return lambda cls: ActorClass

    def get(self, refs):
        raise self.RayActorError("The actor died because of an error raised in its creation task")

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)

    def is_initialized(self):
        return self.initialized

    def shutdown(self):
        self.initialized = False


@pytest.mark.parametrize("pool_started_ray", [True, False])
def test_pool_that_fails_to_start_kills_its_actors_and_shuts_down_only_the_ray_it_started(monkeypatch, pool_started_ray):
    """A worker whose constructor fails (bad model path on a node, out of memory, ...) makes the pool's
    constructor raise. The actors already started and the Ray session the pool started must not outlive
    it: else the next pool in this process finds Ray running, takes it for the caller's, and never shuts
    it down. A caller's own Ray session stays up."""
    fake = _FakeRay()
    monkeypatch.setattr(ray_rollout.RayRolloutPool, "check", staticmethod(lambda config: fake))
    monkeypatch.setattr(ray_rollout, "init_ray", lambda address="", num_cpus=None: pool_started_ray)
    config = load_config("sokoban", ["model=tiny", "rollout.backend=ray", "rollout.num_workers=2",
                                     "rollout.env_groups=2", "rollout.group_size=2"])
    with pytest.raises(fake.RayActorError):
        ray_rollout.RayRolloutPool(config)
    assert len(fake.spawned) == 2
    assert fake.killed == fake.spawned
    assert bool(fake.initialized) is not pool_started_ray
