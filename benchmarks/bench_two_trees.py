"""The same timings from two source trees of ragen side by side, alternated in one run: the check that a change of
structure costs no speed.

    .venv/bin/python benchmarks/bench_two_trees.py OLD_TREE NEW_TREE            # 2 rounds, A B B A ...
    .venv/bin/python benchmarks/bench_two_trees.py OLD NEW --rounds 1 --steps 3 --model tiny   # a smoke run

Each tree is a checkout (``git worktree add /tmp/old REV``). Every measurement runs in a fresh child process with
``PYTHONPATH=TREE``, in the order A B B A (per round), so drifts of the machine hit both trees alike. A child:

* builds ``StarPOTrainer`` from the ``bandit`` preset (the main job), runs one warm-up step, then ``--steps`` steps,
  timing each step's rollout and update (``time/rollout_s``, ``time/update_s``) and their sum (the step);
* builds it from the ``sokoban`` preset and times one multi-turn rollout (``trainer.rollout``).

Printed: the machine, each child's medians, and per quantity the median over rounds of the ratio NEW / OLD.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, statistics, sys, tempfile, time
import torch
torch.set_num_threads(int(sys.argv[3]))
from ragen.config import load_config
from ragen.train.trainer import StarPOTrainer
model, steps = sys.argv[1], int(sys.argv[2])
common = [f"model={model}", "trainer.progress_bar=false", "trainer.plot=false", "trainer.save_final=false",
          "trainer.logger=[jsonl]", "trainer.device=cpu", f"trainer.num_threads={sys.argv[3]}"]
out = {}
with tempfile.TemporaryDirectory() as tmp:
    trainer = StarPOTrainer(load_config("bandit", [*common, f"trainer.output_dir={tmp}/bandit"]))
    rollout, update = [], []
    for step in range(steps + 1):
        t0 = time.perf_counter(); trajectories = trainer.rollout(step + 1); t1 = time.perf_counter()
        trainer.update(trajectories); t2 = time.perf_counter()
        if step:  # step 0 warms up (first casts, the C++ build check)
            rollout.append(t1 - t0); update.append(t2 - t1)
    out["bandit rollout s"] = statistics.median(rollout)
    out["bandit update s"] = statistics.median(update)
    out["bandit step s"] = statistics.median(r + u for r, u in zip(rollout, update))
    del trainer
    trainer = StarPOTrainer(load_config("sokoban", [*common, f"trainer.output_dir={tmp}/sokoban"]))
    trainer.rollout(1)  # warm-up
    t0 = time.perf_counter(); trainer.rollout(2); out["sokoban multi-turn rollout s"] = time.perf_counter() - t0
print("RESULT " + json.dumps(out), flush=True)
'''


def run_child(tree: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.steps), str(args.threads)], env=env,
                          cwd=os.path.abspath(tree), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    flags = next((x for x in open("/proc/cpuinfo") if x.startswith("flags")), "")
    kind = "AVX-512 BF16" if "avx512_bf16" in flags else "AMX" if "amx_bf16" in flags else "AVX2 (fp32)"
    print(f"machine: {cpu} ({kind}), {os.cpu_count()} CPUs; model {args.model}; torch threads {args.threads}")
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for rnd in range(args.rounds):
        for which in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
            result = run_child(getattr(args, which), args)
            runs[which].append(result)
            print(f"  round {rnd} {which}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
    print("| quantity | old (median s) | new (median s) | new / old, median of same-round ratios |")
    print("|---|---:|---:|---:|")
    for key in runs["old"][0]:
        old = statistics.median(r[key] for r in runs["old"])
        new = statistics.median(r[key] for r in runs["new"])
        ratio = statistics.median(n[key] / o[key] for o, n in zip(runs["old"], runs["new"]))
        print(f"| {key} | {old:.2f} | {new:.2f} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
