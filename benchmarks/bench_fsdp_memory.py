"""Per-rank memory of a 2-rank update with and without ``trainer.fsdp``, on the embedded model.

    .venv/bin/python benchmarks/bench_fsdp_memory.py                  # smollm2-135m, 2 RL steps per arm, ~6 min here
    .venv/bin/python benchmarks/bench_fsdp_memory.py --model tiny     # seconds: checks the script runs

Each arm is one ``torchrun --nproc_per_node=2`` job of this script (``--rank-job``): every rank
builds a :class:`StarPOTrainer` from the ``bandit`` preset (the main job's batch: 8 groups × 4
episodes, micro-batch 16), runs ``--steps`` RL steps (rank 0 rolls out, both ranks update,
validation off) and then reports, per rank:

* the bytes each rank holds for the training state, counted exactly: parameters, gradients and
  AdamW moments (a sharded tensor counts its local shard only; ``to_local()``);
* rank 0's generation replica (FSDP only: an unsharded copy of the model rank 0 generates with);
* ``VmHWM``: the process's peak resident memory over the whole run (imports, model, rollout,
  update), and ``VmRSS`` at the end (after the last update), from ``/proc/self/status``.

Resident memory also depends on the allocator: glibc keeps freed blocks below its (adaptive)
mmap threshold in the heap, and FSDP allocates and frees a layer's gathered weights and
gradients on every pass. Run once as is and once with ``MALLOC_MMAP_THRESHOLD_=65536`` (large
blocks mapped and unmapped, so freed memory returns to the OS) to see both.

The two arms run one after the other with the same seed and batch; the state counts do not
depend on the machine's load, the peak RSS can (allocator timing), and the seconds do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def status_mib(key: str) -> float:
    """``VmHWM`` (peak resident) or ``VmRSS`` (resident now) of this process, MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def rank_job(args) -> None:
    import torch

    from ragen.config import load_config
    from ragen.train.trainer import StarPOTrainer

    torch.set_num_threads(1)
    start = time.perf_counter()
    config = load_config("bandit", [
        f"model={args.model}", f"trainer.fsdp={str(args.fsdp).lower()}", f"trainer.total_steps={args.steps}",
        "trainer.val_before_train=false", "trainer.val_episodes=1", "trainer.save_final=false", "trainer.plot=false",
        "trainer.progress_bar=false", "trainer.device=cpu", f"trainer.output_dir={args.out}",
    ])
    trainer = StarPOTrainer(config)
    trainer.train()
    params = list(trainer.actor.trainable_parameters())
    moments = [v for p in params for k, v in trainer.optimizer.state.get(p, {}).items() if k != "step"]
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    row = {
        "rank": trainer.rank, "fsdp": trainer.fsdp,
        "params_mib": local_bytes(params + frozen) / 2**20,
        "grads_mib": local_bytes([p.grad for p in params if p.grad is not None]) / 2**20,
        "adamw_mib": local_bytes(moments) / 2**20,
        "replica_mib": (local_bytes(trainer.rollout_model.parameters()) / 2**20
                        if trainer.fsdp and trainer.rollout_model is not None else 0.0),
        "peak_rss_mib": status_mib("VmHWM"), "end_rss_mib": status_mib("VmRSS"), "wall_s": time.perf_counter() - start,
    }
    Path(args.out, f"rank{trainer.rank}.json").write_text(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=2, help="RL steps per arm (AdamW's moments exist from step 1's end)")
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        rank_job(args)
        return

    from machine import machine

    print(f"machine: {machine()}")
    print(f"command: {' '.join(sys.argv)}; MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', '(glibc default)')}")
    rows = []
    for fsdp in (False, True):
        out = Path(f"/tmp/bench_fsdp_memory/{'fsdp' if fsdp else 'ddp'}-{os.getpid()}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(29500 + os.getpid() % 1000),
               __file__, "--rank-job", "--model", args.model, "--steps", str(args.steps), "--out", str(out)]
        if fsdp:
            cmd.append("--fsdp")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            sys.exit(f"torchrun failed ({'fsdp' if fsdp else 'ddp'}):\n{proc.stderr[-3000:]}")
        found = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        print(f"{'fsdp' if fsdp else 'ddp '}: torchrun {time.perf_counter() - t0:.0f} s")
        rows += found
    print()
    print("| update | rank | parameters MiB | gradients MiB | AdamW moments MiB | training state MiB | generation replica MiB | peak RSS MiB | RSS at end MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        state = r["params_mib"] + r["grads_mib"] + r["adamw_mib"]
        print(f"| {'FSDP' if r['fsdp'] else 'replicated (DDP-style)'} | {r['rank']} | {r['params_mib']:.1f} | {r['grads_mib']:.1f} | "
              f"{r['adamw_mib']:.1f} | {state:.1f} | {r['replica_mib']:.1f} | {r['peak_rss_mib']:.0f} | {r['end_rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
