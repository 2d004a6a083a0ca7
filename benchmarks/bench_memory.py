"""Peak RSS of a full fine-tune and a LoRA run of the embedded 135M model at the main job's batch.

    .venv/bin/python benchmarks/bench_memory.py                     # load-only, full, LoRA r=16, 2 RL steps each
    .venv/bin/python benchmarks/bench_memory.py --validate --threads 2 --runs full

Every run is a fresh child process (this script with ``--child``), so peaks never mix:

* ``load``: imports, then ``ragen.models.load_model("smollm2-135m")`` only (the baseline), then
  every weight read once: the safetensors are memory-mapped, so right after loading most of
  the 4·N bytes of weights are not resident yet.
* ``full``: a :class:`StarPOTrainer` built from the ``bandit`` preset (the main job: 8 groups × 4
  envs = 32 episodes per step, micro-batch 16, one AdamW step per RL step, precision ``auto``),
  its weights read once (as above), then what ``trainer.train()`` does: with ``--validate``,
  validation (``val_before_train``: 2 tags × 64 episodes, generation batch 64), then ``--steps``
  RL steps of ``trainer.rollout`` + ``trainer.update``. AdamW allocates its two moments in
  step 1's optimizer step, so step 2 is the first step that holds weights, moments, gradients
  and activations at once: the steady state.
* ``lora``: the same with ``lora.rank=16`` (peft adapters on every linear layer, ``lora.alpha``
  from the config).
* ``full-ckpt``, ``lora-ckpt``: ``full`` and ``lora`` with ``trainer.gradient_checkpointing=true``
  (each decoder layer's activations recomputed in the backward pass; ragen/models/checkpointing.py).

``--preset`` picks another preset than the main job's (e.g. ``frozenlake_slippery_study``: twenty-turn
chats of ~1 100 tokens, where activations dominate), and ``--set KEY=VALUE`` adds config overrides
to every training child (e.g. ``--set algorithm.micro_batch_size=4``).

Inside the child, each stage's peak is read from ``/proc/self/status`` (``VmHWM``) and the
high-water mark is then reset (``/proc/self/clear_refs`` ← 5), so a stage's peak is its own;
the whole run's peak is the largest stage peak (what ``ru_maxrss`` would report without the
resets). The parent also prints the child's ``ru_maxrss`` from ``os.wait4`` (peak since the
last reset, i.e. of the last stage) as a cross-check.

The logits claim ("never ``B × T × V`` in fp32 at once") is checked by instrumenting the LM
head during each update: a forward hook records the shape and dtype of every output it produces,
next to the ``B × T × V × 4`` bytes the whole batch (and one micro-batch) would take, and the
``chunk_size`` that ``ragen.train.logprobs.policy_forward`` uses.
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
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL = "smollm2-135m"  # ragen's embedded default
MiB = 1024**2


# ---------------------------------------------------------------------------- child
def status_kib(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    return out


def malloc_kib() -> tuple[int, int] | None:
    """glibc heap: (bytes in use incl. mmapped chunks, free bytes malloc keeps instead of returning them), in KiB."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None
    m = libc.mallinfo2()
    return (m.uordblks + m.hblkhd) // 1024, m.fordblks // 1024


class StageRecorder:
    """Peak (VmHWM) and end RSS per stage; the high-water mark is reset after each stage."""

    def __init__(self):
        self.stages: list[dict] = []
        self.can_reset = True
        self.t = time.perf_counter()
        self.logits: dict | None = None  # the current stage's LM-head outputs

    def start(self) -> None:
        self.t = time.perf_counter()
        self.logits = {"calls": 0, "max_elems": 0, "max_shape": None, "dtype": None}

    def reset_peak(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.can_reset = False

    def end(self, name: str, **extra) -> None:
        s = status_kib("VmRSS", "VmHWM", "RssAnon", "RssFile")
        heap = malloc_kib()
        self.stages.append({"stage": name, "seconds": time.perf_counter() - self.t, "rss_kib": s["VmRSS"],
                            "peak_kib": s["VmHWM"], "anon_kib": s.get("RssAnon"), "file_kib": s.get("RssFile"),
                            "heap_used_kib": heap and heap[0], "heap_free_kib": heap and heap[1],
                            "logits": self.logits, **extra})
        print(f"    [{name}] {time.perf_counter() - self.t:.1f} s, RSS {s['VmRSS'] / 1024:.0f} MiB, {extra}, "
              f"stage peak {s['VmHWM'] / 1024:.0f} MiB", file=sys.stderr, flush=True)
        self.reset_peak()
        self.start()

    def lm_head_hook(self, module, inputs, output) -> None:
        if self.logits is None:
            return
        out = output if hasattr(output, "numel") else output[0]
        rec = self.logits
        rec["calls"] += 1
        if out.numel() > rec["max_elems"]:
            rec.update(max_elems=out.numel(), max_shape=list(out.shape), dtype=str(out.dtype).replace("torch.", ""),
                       max_bytes=out.numel() * out.element_size())


def touch(model) -> None:
    """Read every parameter once, so memory-mapped weights are resident (what the first forward pass does)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.sum()


def batch_shape(trajectories, micro: int) -> dict:
    """The update's tensor shapes: whole batch ``B × T`` and the largest micro-batch (rows are permuted, so bound it)."""
    lengths = sorted((len(t.input_ids) for t in trajectories if not t.error and t.response_length > 0), reverse=True)
    return {"rows": len(lengths), "max_len": lengths[0], "micro_rows": min(micro, len(lengths)),
            "response_tokens": sum(t.response_length for t in trajectories)}


def run_child(args) -> dict:
    rec = StageRecorder()
    rec.reset_peak()
    rec.start()
    import torch

    torch.set_num_threads(args.threads)
    import transformers

    from ragen.config import load_config
    from ragen.models import load_model
    from ragen.models.lora import base_model
    from ragen.train import logprobs
    from ragen.train.trainer import StarPOTrainer

    rec.end("imports (torch, transformers, ragen)")
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "ragen": logprobs.__file__,
            "threads": torch.get_num_threads(), "chunk_size": logprobs.policy_forward.__kwdefaults__["chunk_size"]}
    if args.child == "load":
        model, _ = load_model(args.model)
        n = sum(p.numel() for p in model.parameters())
        rec.end(f"load_model({args.model})")
        touch(model)
        rec.end("read every weight once (mmap paged in)")
        return {**info, "stages": rec.stages, "params": n, "trainable": 0, "can_reset": rec.can_reset}

    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        overrides = [f"trainer.output_dir={tmp}/run", "trainer.progress_bar=false", "trainer.plot=false",
                     "trainer.save_final=false", "trainer.logger=[jsonl]", f"trainer.num_threads={args.threads}", f"model={args.model}",
                     f"lora.rank={args.lora_rank if args.child.startswith('lora') else 0}", "trainer.device=cpu",  # RSS of a CPU run
                     *args.set, f"trainer.gradient_checkpointing={args.child.endswith('-ckpt')}"]  # the run kind wins
        config = load_config(args.preset, overrides)
        trainer = StarPOTrainer(config)
        n = sum(p.numel() for p in trainer.model.parameters())
        trainable = sum(p.numel() for p in trainer.actor.trainable_parameters())
        head = base_model(trainer.model).get_output_embeddings()
        rec.end("build StarPOTrainer (load model, LoRA, AdamW, backend)")
        touch(trainer.model)
        rec.end("read every weight once (mmap paged in)")
        info.update(precision=config.trainer.precision, micro_batch=config.algorithm.micro_batch_size,
                    vocab=int(head.weight.shape[0]),
                    max_new_tokens=config.rollout.max_new_tokens, generation_batch=config.rollout.batch_size,
                    lora_rank=config.lora.rank, lora_alpha=config.lora.alpha,
                    checkpointing=config.trainer.gradient_checkpointing)
        fused = getattr(getattr(trainer, "backend", None), "fused", None)
        steps = lambda: fused.fused_steps if fused is not None else 0  # noqa: E731
        if args.validate:
            val = trainer.validate()
            rec.end("validation", success=val.get("val/success"), fused_decode_steps=steps())
        for step in range(1, args.steps + 1):
            trajectories = trainer.rollout(step)
            rec.end(f"step {step} rollout", episodes=len(trajectories), fused_decode_steps=steps())
            shape = batch_shape(trajectories, config.algorithm.micro_batch_size)
            # hooked only in the update: a hooked model would decode through transformers' modules, not the fused step
            handle = head.register_forward_hook(rec.lm_head_hook)
            metrics = trainer.update(trajectories)
            handle.remove()
            rec.end(f"step {step} update", shape=shape, loss=metrics.get("actor/loss"))
    return {**info, "stages": rec.stages, "params": n, "trainable": trainable, "can_reset": rec.can_reset}


# ---------------------------------------------------------------------------- parent
def spawn(kind: str, args) -> tuple[dict, int, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--threads", str(args.threads), "--model", args.model,
           "--steps", str(args.steps), "--lora-rank", str(args.lora_rank), "--preset", args.preset] + \
        [f"--set={kv}" for kv in args.set] + (["--validate"] if args.validate else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"child {kind} failed (exit {proc.returncode})")
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    return result, usage.ru_maxrss, time.perf_counter() - t0  # ru_maxrss in KiB on Linux


def mib(kib: float) -> str:
    return f"{kib / 1024:,.0f}"


def cpu_busy_s() -> float:
    """Seconds of CPU time all processes spent busy so far (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    import resource

    return sum(getattr(resource.getrusage(w), a) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for a in ("ru_utime", "ru_stime"))


def run_name(kind: str, r: dict, long: bool = False) -> str:
    if kind == "load":
        return "load only" if long else "load_model only"
    name = "full fine-tune" if kind.startswith("full") else f"LoRA r={r.get('lora_rank')}" + (f" alpha={r.get('lora_alpha')}" if long else "")
    return name + (", activation checkpointing" if r.get("checkpointing") else "")  # what the child ran


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    kinds = ["load", "full", "lora", "full-ckpt", "lora-ckpt"]
    ap.add_argument("--runs", nargs="+", default=["load", "full", "lora"], choices=kinds)
    ap.add_argument("--preset", default="bandit", help="config preset of the training runs (default: the main job's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every training run")
    ap.add_argument("--steps", type=int, default=2, help="RL steps (rollout + update) per training run")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--validate", action="store_true", help="run one validation (2 x 64 episodes) before the steps")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads in each child (1: robust on a shared machine; RSS hardly depends on it)")
    ap.add_argument("--model", default=MODEL, help="model spec (tiny: a seconds-long smoke run)")
    ap.add_argument("--child", choices=kinds, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        print("RESULT " + json.dumps(run_child(args)), flush=True)
        return 0

    sys.stdout.reconfigure(line_buffering=True)  # the children's stage lines (stderr) interleave in order
    t_start, busy0, own0 = time.perf_counter(), cpu_busy_s(), own_cpu_s()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    total_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, {total_mem / 1024**3:.0f} GiB RAM, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; python {platform.python_version()}")
    results = {}
    for kind in args.runs:
        print(f"run {kind}: fresh child process", flush=True)
        results[kind] = spawn(kind, args)
    wall = time.perf_counter() - t_start
    others = (cpu_busy_s() - busy0) - (own_cpu_s() - own0)
    any_result = next(iter(results.values()))[0]
    print(f"torch {any_result['torch']}, transformers {any_result['transformers']}, torch threads {any_result['threads']}, "
          f"ragen from {os.path.dirname(os.path.dirname(any_result['ragen']))}")
    trained = [r for kind, (r, _, _) in results.items() if kind != "load"]
    if trained:
        r = trained[0]
        episodes = next((s["episodes"] for s in r["stages"] if "episodes" in s), None)  # what a rollout returned
        print(f"shape ({args.preset} preset{', ' + ' '.join(args.set) if args.set else ''}): {episodes} "
              f"episodes/step, <= {r['max_new_tokens']} new tokens, micro-batch {r['micro_batch']}, "
              f"generation batch {r['generation_batch']}, precision {r['precision']}, {args.steps} RL steps"
              f"{' after one validation' if args.validate else ''}")

    # -- per-stage tables ------------------------------------------------------------------
    for kind, (r, ru_maxrss, seconds) in results.items():
        title = run_name(kind, r, long=True)
        print(f"\n{title}: {r['params'] / 1e6:.1f} M parameters, {r['trainable'] / 1e6:.2f} M trainable; "
              f"child wall {seconds:.0f} s; ru_maxrss (since the last reset) {mib(ru_maxrss)} MiB")
        print("| stage | s | RSS at end, MiB (anon + file) | malloc at end, MiB: in use / freed but kept "
              "| stage peak RSS (MiB) | largest LM-head output |")
        print("|---|---|---|---|---|---|")
        for s in r["stages"]:
            lg = s["logits"]
            head = "-" if not lg or not lg["calls"] else (f"{lg['calls']} calls, max {tuple(lg['max_shape'])} "
                                                          f"{lg['dtype']} = {lg['max_bytes'] / MiB:.1f} MiB")
            heap = "-" if s["heap_used_kib"] is None else f"{mib(s['heap_used_kib'])} / {mib(s['heap_free_kib'])}"
            print(f"| {s['stage']} | {s['seconds']:.1f} | {mib(s['rss_kib'])} ({mib(s['anon_kib'])} + {mib(s['file_kib'])}) "
                  f"| {heap} | {mib(s['peak_kib'])} | {head} |")

    # -- summary ---------------------------------------------------------------------------
    load_rss = results["load"][0]["stages"][2]["rss_kib"] if "load" in results else None
    print("\n| run | trainable params | RSS after loading, weights resident (MiB) | whole-run peak RSS (MiB) | peak - loaded model (MiB) "
          "| weights + grads + AdamW moments, fp32 (MiB) |")
    print("|---|---|---|---|---|---|")
    for kind, (r, _, _) in results.items():
        peak = max(s["peak_kib"] for s in r["stages"])
        loaded = r["stages"][2]["rss_kib"]  # after load_model / building the trainer, weights paged in
        static = 4 * r["params"] + 12 * r["trainable"]
        name = run_name(kind, r)
        print(f"| {name} | {r['trainable'] / 1e6:.2f} M | {mib(loaded)} | {mib(peak)} | "
              f"{'-' if kind == 'load' else mib(peak - loaded)}"
              f"{'' if load_rss is None or kind == 'load' else f' (vs load-only child: {mib(peak - load_rss)})'} "
              f"| {static / MiB:,.0f} |")

    # -- the logits claim ------------------------------------------------------------------
    for kind in results:
        if kind == "load":
            continue
        r = results[kind][0]
        updates = [s for s in r["stages"] if s["stage"].endswith("update")]
        V = r["vocab"]
        print(f"\nlogits in the update ({kind}; policy_forward chunk_size = {r['chunk_size']} rows):")
        for s in updates:
            sh, lg = s["shape"], s["logits"]
            T = sh["max_len"] - 1
            whole = sh["rows"] * T * V * 4
            micro = sh["micro_rows"] * T * V * 4
            print(f"  {s['stage']}: batch {sh['rows']} rows x T={T}, {sh['response_tokens']} response tokens; "
                  f"largest LM-head output {tuple(lg['max_shape'])} {lg['dtype']} = {lg['max_bytes'] / MiB:.1f} MiB "
                  f"({lg['calls']} calls); B x T x V fp32 would be {whole / MiB:,.0f} MiB for the batch, "
                  f"{micro / MiB:,.0f} MiB for one micro-batch of {sh['micro_rows']} "
                  f"({micro / lg['max_bytes']:.0f}x the largest block)")
    if not all(r["can_reset"] for r, _, _ in results.values()):
        print("note: /proc/self/clear_refs was not writable: stage peaks are cumulative")
    print(f"\ntotal wall time {wall:.0f} s; CPU used by other processes meanwhile: {others:.0f} core-s "
          f"(avg {others / wall:.2f} of {os.cpu_count()} cores; RSS is not affected, stage seconds are)")
    from ragen.runtime import requested

    print("children's allocator: " + ("glibc keeps freed memory (RAGEN_MALLOC=keep, ragen/runtime.py)" if requested() else
                                      "the C library's defaults or the environment's own MALLOC_* settings"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
