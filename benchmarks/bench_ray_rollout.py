"""Rollout throughput: local rollout vs Ray rollout workers (``rollout.backend=ray``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ray_rollout.py                  # smollm2-135m, local / ray x1 / ray x2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ray_rollout.py --model tiny --steps 1   # smoke run (seconds)
    .venv/bin/python benchmarks/bench_ray_rollout.py --workers 1 2 4 --threads 2 --address auto  # on a Ray cluster

Needs Ray (``pip install -e '.[ray]'``). Each variant builds a real :class:`StarPOTrainer` on
the same config and times ``trainer.rollout(step)`` only (no update, the weights never
change): ``--warmup`` untimed steps, then ``--steps`` timed ones. Every variant draws the same
seeds per step (same run seed); sampling streams differ between backends (Ray workers seed
from (step, worker)), so generated token counts differ a little: compare tokens/s, not tokens.

Reported per variant: worker start-up (actors load their own model copy), seconds per
rollout step, episodes/s and generated (model-written) tokens/s. ``--threads`` sets
``trainer.num_threads`` for the local rollout and for every worker (default 1: one core per
worker, the same for the local rollout). A local Ray cluster is started here unless
``--address`` names one; usage statistics are off and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from machine import machine  # noqa: E402  (benchmarks/machine.py, next to this script)


def run_variant(name: str, overrides: list[str], args) -> dict:
    from ragen.config import load_config
    from ragen.train.trainer import StarPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(args.env, [*overrides, f"trainer.output_dir={tmp}/run", "trainer.device=cpu"])
        t0 = time.perf_counter()
        trainer = StarPOTrainer(config)
        startup = time.perf_counter() - t0
        try:
            for step in range(1, args.warmup + 1):
                trainer.rollout(step)
            times, episodes, tokens = [], 0, 0
            for step in range(args.warmup + 1, args.warmup + args.steps + 1):
                t = time.perf_counter()
                trajectories = trainer.rollout(step)
                times.append(time.perf_counter() - t)
                episodes += len(trajectories)
                tokens += sum(traj.response_length for traj in trajectories)
        finally:
            trainer.close_rollout_pool()
            del trainer
            gc.collect()
    total = sum(times)
    return {"variant": name, "startup_s": startup, "step_s": statistics.mean(times), "episodes_s": episodes / total,
            "tokens_s": tokens / total, "tokens_per_step": tokens / len(times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (embedded) or tiny")
    p.add_argument("--env", default="sokoban")
    p.add_argument("--groups", type=int, default=None,
                   help="rollout.env_groups (default 4; a preset with es.train takes its entries' groups instead)")
    p.add_argument("--group-size", type=int, default=4, help="rollout.group_size")
    p.add_argument("--max-turn", type=int, default=3, help="agent.max_turn (an es.train preset's tags set their own)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="Ray worker counts to run")
    p.add_argument("--no-local", action="store_true", help="skip the local variant")
    p.add_argument("--threads", type=int, default=1, help="trainer.num_threads (local rollout and each worker)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--address", default="", help="Ray cluster address (default: start a local cluster)")
    args = p.parse_args(argv)
    from ragen.config import load_config

    from ragen.agent.env_sets import train_sets

    preset = load_config(args.env, [f"agent.max_turn={args.max_turn}"])
    mix = preset.es.train
    if mix and args.groups is not None:
        p.error(f"--env {args.env} trains on es.train tags: its groups come from their entries, not --groups")
    groups = sum(entry.groups for entry in mix) if mix else (4 if args.groups is None else args.groups)
    turns = ", ".join(f"{s.name}: {s.settings.max_turn}" for s in train_sets(preset))  # a tag's horizon wins

    import ray
    import torch

    from ragen.train.ray_rollout import init_ray

    common = [f"model={args.model}", *([] if mix else [f"rollout.env_groups={groups}"]), f"rollout.group_size={args.group_size}",
              f"agent.max_turn={args.max_turn}", f"rollout.max_new_tokens={args.max_new_tokens}",
              f"trainer.num_threads={args.threads}", "trainer.progress_bar=false"]
    print(f"machine: {machine()}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, ray {ray.__version__}")
    print(f"settings: model={args.model} env={args.env} groups={groups}x{args.group_size} "
          f"({groups * args.group_size} episodes/step) max_turn=({turns}) max_new_tokens={args.max_new_tokens} "
          f"threads={args.threads} warmup={args.warmup} steps={args.steps} temperature=1.0 (sampled)")

    rows = []
    if not args.no_local:
        rows.append(run_variant("local", [*common, "rollout.backend=local"], args))
    started = init_ray(args.address, num_cpus=max(max(args.workers) + 1, os.cpu_count() or 1))
    try:
        for n in args.workers:
            address = [f"rollout.ray_address={args.address}"] if args.address else []
            rows.append(run_variant(f"ray x{n}", [*common, "rollout.backend=ray", f"rollout.num_workers={n}", *address], args))
    finally:
        if started:
            ray.shutdown()

    print()
    print("| variant | start-up s | s / rollout step | episodes/s | generated tokens/s | tokens/step |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['startup_s']:.1f} | {r['step_s']:.2f} | {r['episodes_s']:.2f} | "
              f"{r['tokens_s']:.1f} | {r['tokens_per_step']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
