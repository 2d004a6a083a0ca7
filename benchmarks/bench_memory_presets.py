"""Resident memory of every preset over several steps: RL, SFT on each env's expert data, and `ragen eval` at 512
episodes, each in a fresh child process.

    .venv/bin/python benchmarks/bench_memory_presets.py                         # every preset in ragen/configs/, 5 steps
    .venv/bin/python benchmarks/bench_memory_presets.py --presets bandit --steps 50   # a longer look at one preset
    .venv/bin/python benchmarks/bench_memory_presets.py --model tiny --steps 3        # a seconds-long smoke run
    .venv/bin/python benchmarks/bench_memory_presets.py --presets frozenlake_slippery_study --no-rl --no-sft \
        --episodes 128 --threads 1 --set rollout.max_episodes_in_flight=32          # one evaluation, in waves
    .venv/bin/python benchmarks/bench_memory_presets.py --presets frozenlake_slippery_study --no-rl --no-eval \
        --steps 30 --sft-data fls512.jsonl --sft-set trainer.micro_batch_size=4    # SFT on your own data

For each run it prints the peak RSS (``VmHWM``), the RSS after step 3 and after the last step, their growth, and a
split of the peak: the model's weights (4 bytes a parameter), gradients and AdamW's two moments (4 + 8 bytes a
trainable parameter), the process before the model (imports), and the rest (activations, log-prob buffers, KV caches,
allocator overhead: measured as what is left). Growth after step 3 with no tensors kept across steps
(``tests/train/test_no_tensors_kept_across_steps.py``) is the allocator holding freed memory, not a leak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MiB = 2**20

def shipped_presets() -> list[str]:
    """Every preset in ``ragen/configs/``: a new preset is measured without editing this file."""
    from ragen.config import PRESET_DIR

    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))

#: The env each preset plays, for SFT on its expert data.
SFT_ENVS = {"bandit": "bandit", "sokoban": "sokoban", "frozenlake_study": "frozenlake_study",
            "frozenlake_slippery_study": "frozenlake_slippery_study"}


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child_rl(preset: str, steps: int, model: str, threads: int, extra: list[str]) -> dict:
    import torch

    torch.set_num_threads(threads)
    from ragen.config import load_config
    from ragen.train.trainer import StarPOTrainer

    base = status("VmRSS")
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(preset, [f"model={model}", f"trainer.output_dir={tmp}/run", "trainer.progress_bar=false",
                                      "trainer.plot=false", "trainer.save_final=false", "trainer.logger=[jsonl]",
                                      f"trainer.num_threads={threads}", "trainer.device=cpu", *extra])
        trainer = StarPOTrainer(config)
        params = sum(p.numel() for p in trainer.model.parameters())
        trainable = sum(p.numel() for p in trainer.actor.trainable_parameters())
        rss = []
        for step in range(1, steps + 1):
            trainer.update(trainer.rollout(step))
            rss.append(status("VmRSS"))
    return {"base": base, "params": params, "trainable": trainable, "rss": rss, "peak": status("VmHWM")}


def child_sft(env: str, steps: int, model: str, threads: int, extra: list[str], data: str | None = None) -> dict:
    import torch

    torch.set_num_threads(threads)
    from ragen.cli import main as ragen_main
    from ragen.sft.config import load_sft_config
    from ragen.sft.trainer import SFTTrainer

    base = status("VmRSS")
    with tempfile.TemporaryDirectory() as tmp:
        if data is None:
            data = f"{tmp}/data.jsonl"
            if ragen_main(["sft", "generate", env, "--n", "64", "--out", data]) != 0:
                raise SystemExit(f"ragen sft generate {env} failed")
        config = load_sft_config(None, [f"data.path={data}", f"model={model}", f"trainer.output_dir={tmp}/run",
                                        "trainer.progress_bar=false", f"trainer.num_threads={threads}",
                                        "trainer.device=cpu", "trainer.batch_size=16", *extra])
        trainer = SFTTrainer(config)
        params = sum(p.numel() for p in trainer.model.parameters())
        trainable = sum(p.numel() for p in trainer.trainable_parameters())
        from ragen.sft.data import step_examples

        rss = []
        for step in range(1, steps + 1):
            trainer.optimizer_step(step_examples(trainer.data.train, 16, 0, step))
            rss.append(status("VmRSS"))
    return {"base": base, "params": params, "trainable": trainable, "rss": rss, "peak": status("VmHWM")}


def child_eval(preset: str, episodes: int, model: str, threads: int, extra: list[str]) -> dict:
    import torch

    torch.set_num_threads(threads)
    from ragen.config import load_config
    from ragen.eval.evaluate import evaluate

    base = status("VmRSS")
    config = load_config(preset, [f"model={model}", f"trainer.val_episodes={episodes}", "trainer.device=cpu", *extra])
    report = evaluate(config, k=0, baselines=False)
    return {"base": base, "params": 0, "trainable": 0, "rss": [status("VmRSS")], "peak": status("VmHWM"),
            "success": report.get("success")}


def spawn(kind: str, name: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--child-name", name, "--steps", str(args.steps),
           "--model", args.model, "--threads", str(args.threads), "--episodes", str(args.episodes),
           *[f"--set={kv}" for kv in args.set], *[f"--sft-set={kv}" for kv in args.sft_set],
           *([f"--sft-data={os.path.abspath(args.sft_data)}"] if args.sft_data else [])]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1], "seconds": time.perf_counter() - t0}
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), "seconds": time.perf_counter() - t0}


def row(kind: str, name: str, r: dict) -> str:
    if "error" in r:
        return f"| {kind} | {name} | failed: {r['error'][:80]} | | | | | |"
    rss = r["rss"]
    third = rss[min(2, len(rss) - 1)]
    growth = (rss[-1] - third) / third * 100 if third else 0.0
    static = 4 * r["params"] + 12 * r["trainable"]
    rest = r["peak"] - r["base"] - static
    return (f"| {kind} | {name} | {r['peak'] / MiB:,.0f} | {third / MiB:,.0f} | {rss[-1] / MiB:,.0f} | {growth:+.1f} % "
            f"| {r['base'] / MiB:,.0f} + {4 * r['params'] / MiB:,.0f} + {12 * r['trainable'] / MiB:,.0f} + "
            f"{rest / MiB:,.0f} | {r['seconds']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=None, help="presets run (default: every one in ragen/configs/)")
    ap.add_argument("--steps", type=int, default=5, help="RL and SFT steps per run (RSS after step 3 and the last)")
    ap.add_argument("--episodes", type=int, default=512, help="episodes of the eval runs")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="run-config override for every RL and eval run")
    ap.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                    help="SFT-config override for every SFT run (e.g. trainer.micro_batch_size=4)")
    ap.add_argument("--sft-data", help="train SFT on this JSONL (ragen sft generate ...) instead of 64 fresh expert episodes")
    ap.add_argument("--no-rl", action="store_true")
    ap.add_argument("--no-sft", action="store_true")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--eval-presets", nargs="+", default=None, help="presets evaluated (default: every one run)")
    ap.add_argument("--child", choices=["rl", "sft", "eval"], help=argparse.SUPPRESS)
    ap.add_argument("--child-name", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        size = args.episodes if args.child == "eval" else args.steps
        if args.child == "sft":
            result = child_sft(args.child_name, size, args.model, args.threads, args.sft_set, data=args.sft_data)
        else:
            result = {"rl": child_rl, "eval": child_eval}[args.child](args.child_name, size, args.model, args.threads,
                                                                    args.set)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    args.presets = args.presets or shipped_presets()
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")),
               platform.processor())
    flags = next((x for x in open("/proc/cpuinfo") if x.startswith("flags")), "")
    kind = "AVX-512 BF16" if "avx512_bf16" in flags else "AMX" if "amx_bf16" in flags else "AVX2 (fp32)"
    print(f"machine: {cpu} ({kind}), {os.cpu_count()} CPUs; model {args.model}; {args.steps} steps; "
          f"torch threads {args.threads}")
    print("| run | preset / env | peak RSS MiB | RSS after step 3 | RSS after the last | growth | peak split MiB: "
          "process + weights + grads & AdamW + rest | s |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for preset in [] if args.no_rl else args.presets:
        print(row("RL", preset, spawn("rl", preset, args)), flush=True)
    if not args.no_sft:
        for preset in args.presets:
            if preset in SFT_ENVS:
                print(row("SFT", SFT_ENVS[preset], spawn("sft", SFT_ENVS[preset], args)), flush=True)
    if not args.no_eval:
        for preset in args.eval_presets or args.presets:
            print(row(f"eval {args.episodes}", preset, spawn("eval", preset, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
