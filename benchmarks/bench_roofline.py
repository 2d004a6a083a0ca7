"""Roofline: generation and update throughput as model-FLOPs utilisation of this CPU.

    .venv/bin/python benchmarks/bench_roofline.py                   # smollm2-135m, 1 thread, ~4 min
    .venv/bin/python benchmarks/bench_roofline.py --threads 2       # both cores: only on a quiet machine
    .venv/bin/python benchmarks/bench_roofline.py --batches 32 --new-tokens 16 --steps 1 --warmup 1

One process, in this order, so every ratio comes from the same run:

1. **Peaks**: 2048³ matmuls, best of a few, fp32 and bf16, in two layouts: ``A @ B`` and
   ``A @ Bᵀ`` (``F.linear``, the layout of every ``nn.Linear`` in the model). bf16 ``A @ B``
   is measured at 512³ only: without native bf16 torch uses a reference kernel that takes
   about a minute at 2048³. Memory bandwidth: the sum of a 1 GiB fp32 tensor, best of 3.
2. **Update** at the main job's shape: a real :class:`StarPOTrainer` from the ``bandit`` preset
   (8 groups × 4 envs, ≤ 16 new tokens, micro-batch 16, one AdamW step per RL step, precision
   ``auto``), ``--warmup`` untimed then ``--steps`` timed RL steps of ``trainer.rollout`` +
   ``trainer.update``: exactly what ``ragen train bandit`` runs. Two warm-up steps by default: a run's
   first two updates fault in fresh memory (the optimizer's state, the allocator's first large blocks)
   and are not what the rest of a run does (on a Zen 5 EPYC the first two took 4.8 and 2.4 s, the rest
   1.6-1.8 s, with 594 k, 135 k, then 15-40 k page faults).
3. fp32 peak again.
4. **Generation** with the trainer's own ``HFBackend`` at each ``--batches`` size: ``B / group_size``
   distinct bandit prompts (the prompts the rollouts above rendered), each ``group_size`` times,
   as in the main job; exactly ``--new-tokens`` new tokens per row (EOS suppressed with
   ``SamplingParams.min_new_tokens``, no stop string), the main job's temperature / top-p / top-k.
   Unhooked, as in ``ragen train``: the backend's own timers split prefill from decoding. ``--gen-calls``
   calls per batch size (5 by default), each a whole rollout as one RL step makes it (the fused weights built,
   the prompts prefilled, 32 tokens decoded); the median call is the reported figure and the verdict, with every
   call's seconds beside it (consecutive calls can differ by up to 1.4x on a noisy VM).
5. Peaks again.

MFU = model FLOPs / seconds / peak, with 2·N FLOPs per generated
token and 6·N per trained token (N = parameters, tied embedding counted once), against the
best matmul of the precision the run actually uses (``precision=auto`` resolves to fp32
without native bf16) measured right before or after that section (the larger, i.e. the
conservative choice). For the update, "trained tokens" is reported two ways: the tokens
the decoder really ran (shared-prompt KV reuse runs each distinct prompt once per
micro-batch) and the nominal count (every row's whole sequence, what a plain
implementation runs). During the update, forward hooks on the decoder, the LM head and the
optimizer time each part and count the tokens (real and padded) each pass computed; they are
removed for rollouts and generation (a hooked model decodes through transformers' modules,
not :mod:`ragen.models.fused_decode`).

The roofline bound for decoding: each decode step reads every weight once
(4 bytes each in fp32) plus the rows' KV caches, so a step takes at least
max(bytes / bandwidth, 2·N·B / peak); generated tokens/s can be at most B over that.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL = "smollm2-135m"  # ragen's embedded default
TARGET_GEN, TARGET_UPDATE = 0.25, 0.40  # targets: generation >= 25 % at batch >= 32, update >= 40 %


# ---------------------------------------------------------------------------- machine
def cpu_busy_s() -> float:
    """CPU seconds all processes have spent busy so far (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    return sum(getattr(resource.getrusage(w), a) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for a in ("ru_utime", "ru_stime"))


class Contention:
    """CPU time other processes used while a section ran: busy CPU time minus this process's."""

    def __init__(self):
        self.wall, self.busy, self.own = time.perf_counter(), cpu_busy_s(), own_cpu_s()

    def report(self) -> str:
        wall = time.perf_counter() - self.wall
        others = (cpu_busy_s() - self.busy) - (own_cpu_s() - self.own)
        return f"other processes used {max(others, 0):.0f} core-s in {wall:.0f} s (avg {max(others, 0) / wall:.2f} of {os.cpu_count()} cores)"


def matmul_gflops(torch, dtype, size: int, layout: str, reps: int) -> float:
    """Best GFLOP/s of ``reps`` size³ products after one warm-up; layout "A@B" or "A@B^T" (F.linear)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    run = (lambda: torch.matmul(a, b)) if layout == "A@B" else (lambda: torch.nn.functional.linear(a, b))
    run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def peaks(torch, with_bf16: bool) -> dict[str, float]:
    out = {"fp32 A@B 2048": matmul_gflops(torch, torch.float32, 2048, "A@B", 5),
           "fp32 A@B^T 2048": matmul_gflops(torch, torch.float32, 2048, "A@B^T", 5)}
    if with_bf16:
        out["bf16 A@B^T 2048"] = matmul_gflops(torch, torch.bfloat16, 2048, "A@B^T", 3)
        out["bf16 A@B 512"] = matmul_gflops(torch, torch.bfloat16, 512, "A@B", 2)
    print("  matmul GFLOP/s: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    return out


def best_of(p: dict[str, float], dtype: str) -> float:
    return max(v for k, v in p.items() if k.startswith(dtype))


def memory_bandwidth(torch) -> float:
    """GB/s reading a 1 GiB fp32 tensor (``sum``), best of 3."""
    x = torch.ones(256 * 1024**2)
    x.sum()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


# ---------------------------------------------------------------------------- instrumentation
class Probe:
    """Hooks: decoder passes (tokens computed, real tokens, seconds), LM-head rows and seconds, optimizer seconds."""

    def __init__(self, trainer):
        from ragen.models.lora import base_model

        base = base_model(trainer.model)
        self.decoder, self.head = base.get_decoder(), base.get_output_embeddings()
        self.reset()
        self.handles = []
        trainer.optimizer.register_step_pre_hook(lambda *a: self._t_pre())
        trainer.optimizer.register_step_post_hook(lambda *a: self._add("optimizer_s"))

    def attach(self) -> None:
        """Hook the decoder and the LM head (the update's passes)."""
        self.handles = [self.decoder.register_forward_pre_hook(self._dec_pre, with_kwargs=True),
                        self.decoder.register_forward_hook(self._dec_post),
                        self.head.register_forward_pre_hook(self._t_pre),
                        self.head.register_forward_hook(self._head_post)]

    def detach(self) -> None:
        """Remove the module hooks: generation runs unhooked, as in ``ragen train`` (a hooked model keeps
        transformers' modules for its decode steps, ragen.models.fused_decode)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def reset(self) -> None:
        self.c = {k: 0.0 for k in ("prefill_tokens", "prefill_computed", "prefill_s", "decode_tokens", "decode_computed",
                                   "decode_s", "head_rows", "head_s", "optimizer_s")}

    def _t_pre(self, *args) -> None:
        self._t0 = time.perf_counter()

    def _add(self, key: str) -> None:
        self.c[key] += time.perf_counter() - self._t0

    def _dec_pre(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        B, S = ids.shape[:2]
        mask = kwargs.get("attention_mask")
        real = B * S
        if mask is not None and mask.dim() == 2:
            real = int(mask[:, -S:].sum())
        elif mask is not None and mask.dim() == 4 and mask.shape[-2:] == (S, S):
            # a custom (packed-layout) mask: a real token attends to itself, a padding slot does not
            diagonal = mask[:, 0].diagonal(dim1=-2, dim2=-1)  # (B, S)
            real = int((diagonal == 0).sum() if diagonal.dtype.is_floating_point else diagonal.sum())
        self._kind = "prefill" if S > 1 else "decode"
        self.c[f"{self._kind}_tokens"] += real
        self.c[f"{self._kind}_computed"] += B * S
        self._dec_t0 = time.perf_counter()

    def _dec_post(self, module, args, output) -> None:
        self.c[f"{self._kind}_s"] += time.perf_counter() - self._dec_t0

    def _head_post(self, module, args, output) -> None:
        self.c["head_rows"] += output.numel() // output.shape[-1]
        self._add("head_s")


# ---------------------------------------------------------------------------- sections
def run_update_section(trainer, probe, args) -> tuple[list[dict], list[list[int]]]:
    """Main-job RL steps; per timed step the update's tokens and seconds. Returns (steps, distinct prompts seen)."""
    prompts: dict[tuple[int, ...], None] = {}
    steps = []
    for step in range(1, args.warmup + args.steps + 1):
        probe.reset()
        t0 = time.perf_counter()
        trajectories = trainer.rollout(step)
        t1 = time.perf_counter()
        probe.reset()
        probe.attach()
        trainer.update(trajectories)
        probe.detach()
        t2 = time.perf_counter()
        usable = [t for t in trajectories if not t.error and t.response_length > 0]
        for t in trajectories:
            prompts.setdefault(tuple(t.input_ids[: t.loss_mask.index(1)]), None)
        distinct = {tuple(t.input_ids[: t.loss_mask.index(1)]) for t in usable}
        s = {"step": step, "rollout_s": t1 - t0, "update_s": t2 - t1, "rows": len(usable),
             "nominal": sum(len(t.input_ids) for t in usable), "response": sum(t.response_length for t in usable),
             "generated": sum(t.response_length for t in trajectories), **probe.c,
             # the least decoder work: every distinct prompt once, plus every answer
             "once": sum(len(p) for p in distinct) + sum(t.response_length for t in usable)}
        # the update's decoder passes: shared prompts (once per distinct prompt in a micro-batch) and answers on their cache
        s["dec_tokens"] = s["prefill_tokens"] + s["decode_tokens"]
        s["dec_computed"] = s["prefill_computed"] + s["decode_computed"]
        s["forward_s"] = s["prefill_s"] + s["decode_s"] + s["head_s"]
        steps.append(s)
        print(f"  step {step}{' (warm-up)' if step <= args.warmup else ''}: rollout {s['rollout_s']:.2f} s "
              f"({s['generated']} tokens generated), update {s['update_s']:.2f} s: decoder ran {s['dec_tokens']:.0f} real "
              f"tokens ({s['dec_computed']:.0f} with padding), nominal {s['nominal']}, LM head {s['head_rows']:.0f} rows; "
              f"forward {s['forward_s']:.2f} s, optimizer {s['optimizer_s']:.2f} s", flush=True)
    return steps[args.warmup:], [list(p) for p in prompts]


def run_generation_section(trainer, probe, prompts: list[list[int]], args) -> list[dict]:
    from ragen.models import SamplingParams

    r = trainer.config.rollout
    size = r.group_size
    # every row writes exactly new_tokens: EOS suppressed until then, no stop string
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=(),
                            min_new_tokens=args.new_tokens)
    backend = trainer.backend
    out = []
    for B in args.batches:
        distinct = max(1, B // size)
        batch = [prompts[i % len(prompts)] for i in range(distinct) for _ in range(size)][:B]
        calls = []
        for call in range(args.gen_calls):
            stats0 = (backend.stats.prefill_s, backend.stats.decode_s, backend.fused.fused_steps,
                      backend.stats.prefilled_tokens, backend.stats.weights_s)
            t0 = time.perf_counter()
            gens = backend.generate(batch, params)
            seconds = time.perf_counter() - t0
            lengths = [len(g.token_ids) for g in gens]
            res = {"batch": B, "distinct": distinct, "seconds": seconds, "generated": sum(lengths),
                   "exact": all(n == args.new_tokens for n in lengths), "prompt_len": statistics.mean(len(p) for p in batch),
                   # prompt tokens run besides the generated ones: each distinct prompt once, their common prefix once.
                   # HFBackend also counts each row's last prompt token (fed by the first decode step, whose B
                   # token-passes "generated" counts), or each distinct prompt's last token when the prefill ran it
                   # (first_from_prefill: B rows' first tokens came from those U passes, one decode step fewer).
                   # Either way generated + this = the token-passes the call really ran
                   "prefill_tokens": backend.stats.prefilled_tokens - stats0[3] - B,
                   "prefill_s": backend.stats.prefill_s - stats0[0], "decode_s": backend.stats.decode_s - stats0[1],
                   "weights_s": backend.stats.weights_s - stats0[4],  # the fused weights' casts and packs (once per call)
                   "fused_steps": backend.fused.fused_steps - stats0[2]}
            calls.append(res)
            print(f"  batch {B}, call {call + 1}/{args.gen_calls}: {seconds:.2f} s, {res['generated']} tokens "
                  f"({res['generated'] / seconds:.1f} tok/s), every row {args.new_tokens} tokens: {res['exact']}; "
                  f"prefill {res['prefill_s']:.2f} s, fused weights build {res['weights_s']:.2f} s, "
                  f"generate (decode steps) {res['decode_s']:.2f} s, fused decode steps {res['fused_steps']}", flush=True)
        # the median call stands for the batch (each call is a whole rollout: weights built, prompts prefilled, decoded);
        # the fastest and slowest are reported beside it
        ranked = sorted(calls, key=lambda c: c["seconds"])
        median = dict(ranked[len(ranked) // 2])  # with an even count, the slower of the two middle calls
        median["calls"] = [c["seconds"] for c in calls]
        median["exact"] = all(c["exact"] for c in calls)
        out.append(median)
    return out


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64], help="generation batch sizes")
    ap.add_argument("--new-tokens", type=int, default=32, help="exact new tokens per generated row")
    ap.add_argument("--gen-calls", type=int, default=5,
                    help="generate calls per batch size (>= 1); the median call is reported (consecutive calls on a "
                         "noisy VM can differ by a third)")
    ap.add_argument("--steps", type=int, default=3, help="timed main-job RL steps (rollout + update)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed RL steps first (a run's first two updates fault in fresh memory)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: two OpenMP threads on a machine other work shares stall each other; "
                         "peaks and workload use the same count, so MFU is per the cores used)")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"], help="trainer.precision")
    ap.add_argument("--model", default=MODEL, help="model spec (tiny: a smoke run; its MFU means nothing)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.gen_calls < 1:
        ap.error(f"--gen-calls must be at least 1, got {args.gen_calls}")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    from ragen.config import load_config
    from ragen.train.trainer import StarPOTrainer

    flags = open("/proc/cpuinfo").read()
    cpu = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), platform.processor())
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, avx2={'avx2' in flags} avx512f={'avx512f' in flags} "
          f"avx512_bf16={'avx512_bf16' in flags} amx_bf16={'amx_bf16' in flags}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"torch threads {torch.get_num_threads()}, ragen from {os.path.dirname(sys.modules['ragen.config'].__file__)}",
          flush=True)
    t_start, whole = time.perf_counter(), Contention()

    print("peaks (before)", flush=True)
    peak0 = peaks(torch, with_bf16=True)
    bandwidth = memory_bandwidth(torch)
    print(f"  memory bandwidth (sum of 1 GiB fp32): {bandwidth:.1f} GB/s", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench_roofline_") as tmp:
        config = load_config("bandit", [
            "trainer.device=cpu", f"model={args.model}", f"trainer.precision={args.precision}", f"trainer.num_threads={args.threads}",
            f"trainer.output_dir={tmp}/run", "trainer.progress_bar=false", "trainer.plot=false",
            "trainer.save_final=false", "trainer.logger=[jsonl]", f"seed={args.seed}",
        ])
        trainer = StarPOTrainer(config)
        precision = config.trainer.precision  # resolved: fp32 or bf16
        model = trainer.model
        n_params = sum(p.numel() for p in model.parameters())
        probe = Probe(trainer)
        n_head = probe.head.weight.numel()
        n_dec = sum(m.weight.numel() for m in probe.decoder.modules() if isinstance(m, torch.nn.Linear))
        cfg = model.config
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) * 4
        print(f"model {args.model}: N = {n_params / 1e6:.1f} M parameters (decoder linear layers {n_dec / 1e6:.1f} M, "
              f"LM head {n_head / 1e6:.1f} M, tied: {cfg.tie_word_embeddings}); precision {args.precision} -> {precision}; "
              f"bandit preset: {config.rollout.env_groups} groups x {config.rollout.group_size}, "
              f"<= {config.rollout.max_new_tokens} new tokens, micro-batch {config.algorithm.micro_batch_size}", flush=True)

        print(f"update: {args.warmup} warm-up + {args.steps} timed RL steps at the main job's shape", flush=True)
        section = Contention()
        steps, prompts = run_update_section(trainer, probe, args)
        update_contention = section.report()
        print("peaks (between)", flush=True)
        peak1 = peaks(torch, with_bf16=False)

        print(f"generation: batches {args.batches}, exactly {args.new_tokens} new tokens per row, "
              f"{len(prompts)} distinct prompts available", flush=True)
        section = Contention()
        gens = run_generation_section(trainer, probe, prompts, args)
        gen_contention = section.report()
    print("peaks (after)", flush=True)
    peak2 = peaks(torch, with_bf16=True)
    wall = time.perf_counter() - t_start

    dtype = "bf16" if precision == "bf16" else "fp32"
    peak_update = max(best_of(peak0, dtype), best_of(peak1, dtype)) if dtype == "fp32" else best_of(peak0, "bf16")
    peak_gen = max(best_of(peak1, dtype), best_of(peak2, dtype)) if dtype == "fp32" else best_of(peak2, "bf16")

    # -- report ------------------------------------------------------------------------------
    print()
    print("| matmul peak, GFLOP/s | before | between | after |")
    print("|---|---|---|---|")
    for k in peak0:
        print(f"| {k} | {peak0[k]:.1f} | {peak1[k]:.1f} | {peak2[k]:.1f} |" if k in peak1 else f"| {k} | {peak0[k]:.1f} | - | {peak2[k]:.1f} |")
    print(f"memory bandwidth {bandwidth:.1f} GB/s. Peak used for MFU: {dtype} (the precision the run uses), "
          f"update {peak_update:.1f}, generation {peak_gen:.1f} GFLOP/s (best of the measurements around each section)")

    u = {k: statistics.mean(s[k] for s in steps) for k in steps[0]}
    real, nominal, computed, resp, t = u["dec_tokens"], u["nominal"], u["dec_computed"], u["response"], u["update_s"]
    mfu_real = 6 * n_params * real / t / 1e9 / peak_update
    mfu_nominal = 6 * n_params * nominal / t / 1e9 / peak_update
    mfu_hw = 6 * (n_dec * computed + n_head * resp) / t / 1e9 / peak_update
    forward = u["forward_s"]
    print(f"\nupdate at the main job's shape ({config.rollout.env_groups} x {config.rollout.group_size} episodes, "
          f"mean of {len(steps)} timed steps; {update_contention}):")
    print("| s/update | decoder tokens run (real) | with padding | if each prompt ran once | nominal tokens | response tokens "
          "| real tok/s | forward s | optimizer s | backward + rest s | MFU, 6N x tokens run | MFU, executed linear-layer FLOPs "
          "(incl. padding, LM head on response rows only) | MFU, 6N x nominal tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {t:.2f} | {real:.0f} | {computed:.0f} | {u['once']:.0f} | {nominal:.0f} | {resp:.0f} | {real / t:.1f} | {forward:.2f} | "
          f"{u['optimizer_s']:.2f} | {t - forward - u['optimizer_s']:.2f} | {mfu_real:.1%} | {mfu_hw:.1%} | {mfu_nominal:.1%} |")
    print(f"(rollout at this shape, with the stop string: {u['rollout_s']:.2f} s for {u['generated']:.0f} generated tokens)")

    print(f"\ngeneration with HFBackend, exactly {args.new_tokens} new tokens per row, groups of "
          f"{config.rollout.group_size} sharing a prompt ({gen_contention}):")
    print(f"(each row: the median of {args.gen_calls} calls; 'calls s' lists every call's seconds, 'MFU range' the fastest "
          f"and slowest call's)")
    print("| batch | distinct prompts | mean prompt len | s | calls s | generated tok/s | MFU, 2N x generated | MFU range "
          "| MFU incl. prompt prefill "
          "| prefill s | generate s (decode steps, sampling) | fused weights build s | other s | fused decode steps "
          "| roofline bound tok/s | % of bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    verdict_gen = []
    for g in gens:
        tok_s = g["generated"] / g["seconds"]
        mfu = 2 * n_params * tok_s / 1e9 / peak_gen
        mfu_prefill = (2 * n_params * g["generated"] + 2 * n_dec * g["prefill_tokens"]) / g["seconds"] / 1e9 / peak_gen
        ctx = g["prompt_len"] + args.new_tokens / 2  # mean context a decode step attends to
        step_bytes = 4 * (n_dec + n_head) + g["batch"] * ctx * kv_bytes
        step_s = max(step_bytes / (bandwidth * 1e9), 2 * n_params * g["batch"] / (peak_gen * 1e9))
        bound = g["batch"] / step_s
        other = g["seconds"] - g["prefill_s"] - g["decode_s"] - g["weights_s"]
        mfu_of = lambda s: 2 * n_params * g["generated"] / s / 1e9 / peak_gen  # noqa: E731 (every call: the same tokens)
        calls = " / ".join(f"{c:.2f}" for c in g["calls"])
        print(f"| {g['batch']} | {g['distinct']} | {g['prompt_len']:.0f} | {g['seconds']:.2f} | {calls} | {tok_s:.1f} | {mfu:.1%} | "
              f"{mfu_of(max(g['calls'])):.1%}-{mfu_of(min(g['calls'])):.1%} | {mfu_prefill:.1%} | "
              f"{g['prefill_s']:.2f} | {g['decode_s']:.2f} | {g['weights_s']:.2f} | {other:.2f} | {g['fused_steps']} | {bound:.0f} | {tok_s / bound:.1%} |")
        if g["batch"] >= 32:
            verdict_gen.append((g["batch"], mfu))

    print()
    for B, mfu in verdict_gen:
        print(f"target generation >= {TARGET_GEN:.0%} MFU at batch {B}: {mfu:.1%} (median call) -> "
              f"{'met' if mfu >= TARGET_GEN else 'NOT met'}")
    met = min(mfu_real, mfu_hw) >= TARGET_UPDATE
    print(f"target update >= {TARGET_UPDATE:.0%} MFU: {mfu_real:.1%} (6N x tokens the decoder ran), {mfu_hw:.1%} "
          f"(executed linear-layer FLOPs) -> {'met' if met else 'NOT met'}; the decoder ran {real / u['once']:.2f}x the "
          f"tokens of one pass per distinct prompt")
    from ragen.runtime import allocator_state

    print(f"total wall time {wall:.0f} s; {whole.report()}; allocator: {allocator_state()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
