"""Ray rollout workers (``rollout.backend=ray``): the training rollout split over actors.

One job: play one training step's episodes on ``rollout.num_workers`` Ray actors and hand
the trainer back the same :class:`~ragen.agent.Trajectory` list a local rollout gives.

* Each :class:`RolloutWorker` actor holds **its share of the training env slots** — a
  contiguous, group-aligned range (a group's ``group_size`` envs never straddle two workers;
  :func:`partition`) — and a **policy replica**: the run's model loaded with
  :func:`ragen.models.load_model` (plus the same LoRA wrapping), an :class:`HFBackend` and a
  :class:`Rollout` with the run's agent settings.
* Every step the trainer's trainable tensors (the whole model, the top layers, or only the
  LoRA adapters — whatever ``requires_grad``) are put in the object store **once**
  (``ray.put``); each worker copies them into its replica before it plays. Frozen tensors
  never travel: they are the same in every replica because every replica loads the same
  model spec with the same seed.
* The trainer still draws the seeds and group ids; each worker gets its slice, and the
  slices' trajectories are concatenated in worker order, which is the original slot order.
* Sampling is seeded per call from ``(run seed, step, worker index)`` (:func:`worker_seed`),
  so a run is reproducible and a retried slice replays exactly what the lost one would have.
  (It is not the same random stream as a local rollout; greedy decoding gives the same
  trajectories on both backends.)
* If an actor dies (``ray.exceptions.RayActorError``, e.g. ``ActorDiedError``) the pool starts
  a replacement with the same slot range, and resubmits that worker's slice of the step
  with the same weights reference, up to :data:`MAX_RETRIES` times per worker per step. The
  other workers' results are kept, so no trajectory is lost or played twice. An exception the
  rollout code itself raised on a worker (``RayTaskError``) is not retried: the replay would play
  the same seeds with the same weights and raise again (an env's own errors never get there:
  they end their episode and are reported, see ``Trajectory.error``).

* **Validation** runs on the same actors: each also holds a contiguous share of the
  validation slots (:func:`split_evenly`, one episode per slot) and plays it with the
  validation sampling params, the weights of that moment and its own seed stream
  (``stream="val"``); the same fault handling applies.

Only the HF engine is supported on workers. Ray is imported lazily: without
``rollout.backend=ray`` nothing here runs.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict
from typing import Sequence

import numpy as np
import torch

from ragen.agent import AgentConfig, Rollout, Trajectory
from ragen.config import ConfigError, RunConfig
from ragen.engines import SamplingParams, build_engine
from ragen.models import apply_lora, load_model
from ragen.runtime import keep_freed_memory
from ragen.train.distributed import shard
from ragen.agent.env_sets import Slots, train_sets, val_sets

#: Replacements per worker per step before the step fails.
MAX_RETRIES = 3


def partition(n_groups: int, group_size: int, num_workers: int) -> list[tuple[int, int]]:
    """Slot ranges ``[start, end)`` per worker: contiguous, whole groups, sizes within one group.

    At most ``n_groups`` ranges: a worker without a group would have nothing to play.
    """
    workers = max(1, min(num_workers, n_groups))
    return [(first * group_size, last * group_size) for first, last in split_evenly(n_groups, workers)]


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges ``[start, end)`` covering ``0..n``, sizes within one of each other (some may be
    empty): the ranks' split of a batch (:func:`ragen.train.distributed.shard`), as ``(start, end)`` pairs."""
    return [(part.start, part.stop) for part in (shard(n, p, parts) for p in range(parts))]


#: Which of a worker's slot sets a call plays: the training share or the validation share.
STREAMS = ("train", "val")


def worker_seed(run_seed: int, step: int, index: int, stream: str = "train") -> int:
    """The sampling seed of worker ``index`` at ``step`` (independent streams via ``SeedSequence``).

    Validation draws from its own stream, so validating at a step never replays that step's
    training samples.
    """
    entropy = [run_seed, step, index] if stream == "train" else [run_seed, step, index, STREAMS.index(stream)]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def build_slots(config: RunConfig, start: int, end: int) -> Slots:
    """Training slots ``[start, end)`` of ``Slots.build(train_sets(config), group_size)``; only those envs are made."""
    return Slots.build(train_sets(config), config.rollout.group_size, start, end)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the replicas need each step: every parameter that trains, by name, detached on CPU."""
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


class RolloutWorker:
    """One actor's env slots and policy replica (made a Ray actor by :class:`RayRolloutPool`)."""

    def __init__(self, config: RunConfig, index: int, start: int, end: int, val_start: int = 0, val_end: int = 0):
        keep_freed_memory()  # RAGEN_MALLOC=keep: a worker is its own process (ragen/runtime.py)
        if config.trainer.num_threads > 0:
            torch.set_num_threads(config.trainer.num_threads)
        self.config, self.index, self.start, self.end = config, index, start, end
        model, tokenizer = load_model(config.model, seed=config.seed)
        if config.lora.rank > 0:
            lora = config.lora
            model = apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
        self.model = model.eval().requires_grad_(False)
        self.params = dict(self.model.named_parameters())
        backend = build_engine(model, tokenizer, config)
        self.rollout = Rollout(backend, tokenizer, AgentConfig(**asdict(config.agent)), SamplingParams(),
                               max_in_flight=config.rollout.max_episodes_in_flight)
        self.slots = build_slots(config, start, end)
        self.val_slots = Slots.build(val_sets(config), 1, val_start, val_end)  # one env per validation episode

    def ping(self) -> int:
        return os.getpid()

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(weights) - set(self.params))
        if unknown:
            raise KeyError(f"rollout worker {self.index}: no parameter named {unknown[:3]} in the replica")
        for name, value in weights.items():
            self.params[name].copy_(value)

    def run(self, step: int, weights, seeds: list[int], group_ids: list[int], sampling: SamplingParams,
            stream: str = "train") -> list[Trajectory]:
        """Load ``weights``, seed the sampler from ``(seed, step, index, stream)``, play this worker's slots of ``stream``."""
        slots = self.slots if stream == "train" else self.val_slots
        if len(seeds) != len(slots) or len(group_ids) != len(slots):
            raise ValueError(f"rollout worker {self.index}: {len(seeds)} seeds for {len(slots)} {stream} slots")
        if weights is not None:
            self.load_weights(weights)
        seed = worker_seed(self.config.seed, step, self.index, stream)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        self.rollout.sampling = sampling
        return self.rollout.run(slots.envs, seeds, group_ids, slots.env_names, settings=slots.settings, tags=slots.tags)


def init_ray(address: str = "", num_cpus: int | None = None) -> bool:
    """Join ``address`` or start a minimal local cluster; True if this call started Ray (so it shuts it down).

    Usage statistics are switched off before Ray starts: nothing here reaches the network.
    """
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a FutureWarning; CPU only
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    return True


class RayRolloutPool:
    """``rollout.num_workers`` :class:`RolloutWorker` actors over the run's training slots.

    Ray is started here unless it already runs in this process (then it is reused and left
    running by :meth:`close`).
    """

    def __init__(self, config: RunConfig):
        ray = self.ray = self.check(config)
        self.config = config
        r = config.rollout
        n_groups = sum(s.count for s in train_sets(config))
        self.ranges = partition(n_groups, r.group_size, r.num_workers)
        self.val_ranges = split_evenly(sum(s.count for s in val_sets(config)), len(self.ranges))
        self.owns_ray = init_ray(r.ray_address, num_cpus=max(len(self.ranges) + 1, os.cpu_count() or 1))
        self.actor = ray.remote(num_cpus=1, max_restarts=0)(RolloutWorker)
        self.workers = [self._spawn(i) for i in range(len(self.ranges))]
        self.restarts = 0
        try:
            ray.get([w.ping.remote() for w in self.workers])  # constructor errors surface here, not mid-training
        except BaseException:  # no pool for the caller to close: stop the actors (and the Ray this pool started)
            self.close()
            raise

    @staticmethod
    def check(config: RunConfig):
        """Raise :class:`ConfigError` (one line, exit 2) unless this config can run on Ray here; returns ``ray``."""
        try:
            import ray
        except ImportError:  # a config error, not a bare ModuleNotFoundError
            raise ConfigError("rollout.backend=ray needs Ray: pip install 'ragen[ray]'") from None
        if config.rollout.engine == "vllm":
            raise ConfigError("rollout.backend=ray supports the transformers engines (rollout.engine=auto, hf or cpu), "
                              "not vllm")
        return ray

    def _spawn(self, index: int):
        return self.actor.remote(self.config, index, *self.ranges[index], *self.val_ranges[index])

    def _ranges(self, stream: str) -> list[tuple[int, int]]:
        """Each worker's slot range of ``stream`` (training or validation)."""
        return self.ranges if stream == "train" else self.val_ranges

    def _submit(self, index: int, step: int, weights_ref, seeds, group_ids, sampling, stream: str):
        start, end = self._ranges(stream)[index]
        return self.workers[index].run.remote(step, weights_ref, seeds[start:end], group_ids[start:end], sampling, stream)

    def replace(self, index: int) -> None:
        """Start a fresh actor for worker ``index`` (same slot range); the old one is killed if still there."""
        try:
            self.ray.kill(self.workers[index], no_restart=True)
        except Exception:  # already gone
            pass
        self.workers[index] = self._spawn(index)
        self.restarts += 1

    def run(self, step: int, seeds: Sequence[int], group_ids: Sequence[int], sampling: SamplingParams,
            model: torch.nn.Module, stream: str = "train") -> list[Trajectory]:
        """One step's rollout (or, ``stream="val"``, validation): weights into the object store once,
        every worker plays its slice, results in slot order."""
        ray = self.ray
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
        ranges = self._ranges(stream)
        expected = ranges[-1][1]
        if len(seeds) != expected or len(group_ids) != expected:
            raise ValueError(f"{len(seeds)} seeds / {len(group_ids)} group ids for {expected} {stream} slots")
        seeds, group_ids = [int(s) for s in seeds], [int(g) for g in group_ids]
        weights_ref = ray.put(trainable_state(model))
        args = (step, weights_ref, seeds, group_ids, sampling, stream)
        pending = {self._submit(i, *args): i for i in range(len(self.workers)) if ranges[i][1] > ranges[i][0]}
        results: list[list[Trajectory]] = [[] for _ in self.workers]
        failures = [0] * len(self.workers)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            index = pending.pop(ready[0])
            try:
                results[index] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                failures[index] += 1
                if failures[index] > MAX_RETRIES:
                    raise RuntimeError(f"rollout worker {index} died {failures[index]} times at step {step}") from exc
                print(f"[ragen] rollout worker {index} died at step {step} ({type(exc).__name__}); "
                      f"replacing it and replaying its {len(seeds[slice(*ranges[index])])} {stream} episodes", flush=True)
                self.replace(index)
                pending[self._submit(index, *args)] = index
        return [traj for part in results for traj in part]

    def close(self) -> None:
        """Kill the actors; shut Ray down if this pool started it."""
        for w in self.workers:
            try:
                self.ray.kill(w, no_restart=True)
            except Exception:
                pass
        self.workers = []
        if self.owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
