"""Decode levers side by side: linears as ``(W @ hᵀ)ᵀ`` and a KV cache that grows in place.

    .venv/bin/python benchmarks/bench_decode.py --threads 2                  # ~8 min on a quiet machine
    .venv/bin/python benchmarks/bench_decode.py --threads 2 --sections gemm steps --rounds 3
    .venv/bin/python benchmarks/bench_decode.py --threads 2 --sections prefill   # the MAX_ROWS bound, ~1 min
    .venv/bin/python benchmarks/bench_decode.py --threads 2 --sections attention # decode_attention off/on, ~3 min
    .venv/bin/python benchmarks/bench_decode.py --threads 2 --sections fused     # fused decode step off/on, ~2 min
    .venv/bin/python benchmarks/bench_decode.py --threads 2 --sections native --batches 32 64 --rounds 5  # C++ step
    .venv/bin/python benchmarks/bench_decode.py --threads 2 --sections panel --batches 8 16 32 48 64    # fp32 GEMMs

One process; every comparison alternates its arms (A B B A …) so that other work on the
machine slows both alike. Sections (``--sections``):

``gemm``
    Each distinct linear shape of the model (decoder projections and the LM head) alone at
    generation row counts (``--batches`` and ``--gemm-rows``): ``F.linear(h, W)`` vs
    ``(W @ hᵀ)ᵀ``, cycling through enough copies of ``W`` (> 256 MiB) that the weights come
    from memory, as in a decode step of the whole model; then the LM head at the update's
    chunk sizes (``--update-rows``, forward + backward of ``log_softmax``/``gather``, with
    and without a weight gradient).
``steps``
    Decode steps of the model itself (``model(next_token, cache)`` + argmax) at each batch,
    from a ``--prompt-len`` prefill, arms ``plain`` / ``head`` (the LM head alone transposed) /
    ``gemm`` (every linear) / ``grow`` / ``gemm+grow``,
    ``--step-count`` steps per arm per round; median ms per step, and the median over rounds
    of each round's plain/arm ratio (paired: robust to load that changes between rounds).
``prefill``
    One forward of the model over a single prompt of ``--prefill-lens`` tokens (``logits_to_keep=1``,
    as a shared-prompt group's prefill), ``plain`` vs ``gemm`` (every linear switched: the decoder's
    calls of up to ``MAX_ROWS`` rows take the transposed layout, so this checks the bound where it
    applies; the LM head's call has one row and is transposed at every length),
    ``--prefill-count`` forwards per arm per round; median ms and the paired per-round ratio.
``generate``
    ``HFBackend.generate`` end to end (shared-prompt prefill, ``B / 4`` distinct prompts,
    exactly ``--new-tokens`` new tokens, temperature 0.8, inverse-CDF sampling), levers off
    (``transposed_gemm=False, grow_cache=False``) vs on (the defaults), same seed: the tokens must
    match. Generated tok/s and MFU = 2·N·tokens / decode seconds / fp32 matmul peak (2048³,
    best of before/after the section, as ``bench_roofline.py``).
``attention``
    ``HFBackend.generate`` with ``decode_attention`` off (transformers' ``sdpa``) vs on
    (:mod:`ragen.models.decode_attention`), at ``--precision`` (auto: bf16 where the CPU has it),
    once with prompts of equal length (no padding: transformers passes no mask) and once with
    lengths that differ (a padding mask); median decode seconds, the ratio, and how many rows
    sampled the same tokens (bf16 rounding may change some). Both arms keep transformers' modules
    (``fused_decode=False``), as does the ``generate`` section.
``fused``
    ``HFBackend.generate`` with the fused decode step (:mod:`ragen.models.fused_decode`) off vs on,
    every other lever on, at ``--precision``, prompts whose lengths differ between groups; median
    decode seconds, the ratio, MFU of each arm against the same run's matmul peak of that precision,
    and how many rows sampled the same tokens.
``native``
    ``HFBackend.generate`` with ``native_decode`` off vs on, every other lever on, at ``--precision``: in bf16 the C++
    grouped decode step (:mod:`ragen.models.native_decode`), in fp32 the panel GEMM for the decoder's projections
    (:mod:`ragen.models.packed_linear`, off Intel); the same prompts as ``fused``;
    median whole-call and decode seconds, each round's off/on ratio, MFU of the whole call, native steps taken.

``panel``
    Each distinct fp32 linear shape of the model at ``--batches`` rows, weights cycled from memory (> 256 MiB, as in a
    decode step): ``(W @ hᵀ)ᵀ`` on the plain weight (the fp32 decoder projections' path without panels), oneDNN's
    packed GEMM (the fp32 head's) and ragen's panel GEMM (``ragen/models/csrc/panel_gemm.cpp``), alternated; median
    ms and GFLOP/s per arm and the panel GEMM's speed-up over the faster other arm.

Printed first: the command, commit, machine, threads, load; after each section the CPU time
other processes used meanwhile (contention).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_roofline import Contention, matmul_gflops  # noqa: E402
from machine import machine  # noqa: E402


def med_ms(xs) -> float:
    return statistics.median(xs) * 1e3


def alternate(arms: list[str], rounds: int):
    """Arm order per round: forward on even rounds, reversed on odd ones."""
    for r in range(rounds):
        for a in (arms if r % 2 == 0 else arms[::-1]):
            yield r, a


def peak(torch, precision: str = "fp32") -> float:
    """Best 2048³ matmul of the precision (bf16: the ``A @ Bᵀ`` layout of every linear)."""
    if precision == "bf16":
        return matmul_gflops(torch, torch.bfloat16, 2048, "A@B^T", 3)
    return max(matmul_gflops(torch, torch.float32, 2048, "A@B", 3), matmul_gflops(torch, torch.float32, 2048, "A@B^T", 3))


# ---------------------------------------------------------------------------- sections
def gemm_section(torch, model, args) -> None:
    import torch.nn.functional as F

    from ragen.models.transposed_gemm import output_head, transposed_linear

    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear})
    rows = sorted(set(args.batches) | set(args.gemm_rows))
    print(f"\n[gemm] F.linear(h, W) vs (W @ h^T)^T per linear shape (out, in), weights cycled from memory, "
          f"median of {args.rounds} alternated rounds")
    with torch.no_grad():
        for shape in shapes:
            copies = [torch.randn(shape) for _ in range(max(2, -(-(256 << 20) // (shape[0] * shape[1] * 4))))]
            line = []
            for M in rows:
                h = torch.randn(M, shape[1])
                times = {"linear": [], "W@h^T": []}
                for r, arm in alternate(list(times), args.rounds + 1):
                    fn = F.linear if arm == "linear" else transposed_linear
                    t0 = time.perf_counter()
                    for w in copies:
                        fn(h, w)
                    if r > 0:
                        times[arm].append((time.perf_counter() - t0) / len(copies))
                a, b = med_ms(times["linear"]), med_ms(times["W@h^T"])
                line.append(f"{M} rows {a:.3f} -> {b:.3f} ms ({a / b:.2f}x)")
            print(f"  {shape}: " + ", ".join(line), flush=True)
    W = output_head(model).weight.detach()
    V, H = W.shape
    for M in args.update_rows:
        for weight_grad in (True, False):
            times = {"linear": [], "W@h^T": []}
            for r, arm in alternate(list(times), args.rounds + 1):
                w = W.clone().requires_grad_(weight_grad)
                h = torch.randn(M, H, requires_grad=True)
                target = torch.randint(0, V, (M, 1))
                t0 = time.perf_counter()
                logits = F.linear(h, w) if arm == "linear" else transposed_linear(h, w)
                torch.log_softmax(logits.float(), -1).gather(-1, target).sum().backward()
                if r > 0:
                    times[arm].append(time.perf_counter() - t0)
            a, b = med_ms(times["linear"]), med_ms(times["W@h^T"])
            print(f"  update chunk, {M:4d} rows, weight grad {str(weight_grad):5s}: forward+backward linear {a:7.1f} ms, "
                  f"W@h^T {b:7.1f} ms: {a / b:.2f}x", flush=True)


def steps_section(torch, model, tokenizer, args) -> None:
    from transformers.cache_utils import DynamicCache

    from ragen.models.cache_names import output_cache
    from ragen.models.growing_cache import make_growing
    from ragen.models.transposed_gemm import output_head, transposed_linears

    # head: only the LM head in the transposed layout (the lever before every linear was); gemm: every linear
    arms = ["plain", "head", "gemm", "grow", "gemm+grow"]
    text = "You are playing a bandit game. Two arms: Apple and Stuntman. Each arm pays a random reward. Think. " * 8
    prompt = tokenizer(text)["input_ids"][: args.prompt_len]
    n = args.step_count
    print(f"\n[steps] decode steps of the model, prompt {len(prompt)} tokens, {n} steps per arm per round, "
          f"{args.rounds} timed rounds after 1 warm-up round; median ms per step")
    for B in args.batches:
        ids = torch.tensor([prompt] * B)
        with torch.no_grad():
            base = output_cache(model(ids, use_cache=True, logits_to_keep=1))
        mask = torch.ones(B, len(prompt) + n + 1, dtype=torch.long)
        times = {a: [] for a in arms}
        for r, arm in alternate(arms, args.rounds + 1):
            cache = DynamicCache(config=model.config)
            for i, layer in enumerate(base.layers):
                cache.update(layer.keys.clone(), layer.values.clone(), i)
            if "grow" in arm:
                make_growing(cache, len(prompt) + n)
            token = torch.full((B, 1), 42)
            with torch.no_grad(), transposed_linears(output_head(model) if arm == "head" else model, arm in ("head", "gemm", "gemm+grow")):
                for s in range(n):
                    L = len(prompt) + s
                    t0 = time.perf_counter()
                    out = model(input_ids=token, attention_mask=mask[:, : L + 1], position_ids=torch.full((B, 1), L),
                                cache=cache, use_cache=True)
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    if r > 0:
                        times[arm].append(time.perf_counter() - t0)
        plain = med_ms(times["plain"])
        # paired: plain / arm within each round (the arms of a round ran back to back), then the median over rounds
        paired = {a: statistics.median(statistics.median(times["plain"][i * n:(i + 1) * n]) /
                                       statistics.median(times[a][i * n:(i + 1) * n]) for i in range(args.rounds))
                  for a in arms}
        print(f"  batch {B}: " + ", ".join(f"{a} {med_ms(times[a]):.1f} ms ({plain / med_ms(times[a]):.2f}x, "
                                            f"paired per round {paired[a]:.2f}x)" for a in arms), flush=True)


def prefill_section(torch, model, tokenizer, args) -> None:
    from ragen.models.transposed_gemm import MAX_ROWS, transposed_linears

    text = "You are playing a bandit game. Two arms: Apple and Stuntman. Each arm pays a random reward. Think. " * 40
    n = args.prefill_count
    print(f"\n[prefill] one forward over a single prompt (logits_to_keep=1), plain vs gemm (MAX_ROWS = {MAX_ROWS}), "
          f"{n} forwards per arm per round, {args.rounds} timed rounds after 1 warm-up round; median ms")
    text_ids = tokenizer(text)["input_ids"]
    for L in args.prefill_lens:
        ids = torch.tensor([text_ids[:L]])  # (1, L)
        assert ids.shape[1] == L, f"the prompt text has fewer than {L} tokens"
        times = {"plain": [], "gemm": []}
        for r, arm in alternate(list(times), args.rounds + 1):
            with torch.no_grad(), transposed_linears(model, arm == "gemm"):
                for _ in range(n):
                    t0 = time.perf_counter()
                    model(ids, use_cache=True, logits_to_keep=1)
                    if r > 0:
                        times[arm].append(time.perf_counter() - t0)
        paired = statistics.median(statistics.median(times["plain"][i * n:(i + 1) * n]) /
                                   statistics.median(times["gemm"][i * n:(i + 1) * n]) for i in range(args.rounds))
        # The LM head sees one row (logits_to_keep=1), so it is transposed in the gemm arm at every length.
        layout = "transposed" if L <= MAX_ROWS else "plain: above MAX_ROWS"
        print(f"  {L} tokens (gemm arm: decoder linears {layout}, LM head transposed): plain {med_ms(times['plain']):.1f} ms, "
              f"gemm {med_ms(times['gemm']):.1f} ms; plain/gemm paired per round {paired:.2f}x", flush=True)


def generate_section(torch, model, tokenizer, args) -> None:
    from ragen.models.backend import HFBackend, SamplingParams

    n_params = sum(p.numel() for p in model.parameters())
    # both arms decode through transformers' modules (the fused step has its own section); ragen's decode loop and
    # common-prefix prefill (on by default) run in both
    arms = {"levers off": dict(transposed_gemm=False, grow_cache=False, fused_decode=False),
            "levers on": dict(transposed_gemm=True, grow_cache=True, fused_decode=False)}
    # every row writes exactly new_tokens
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.8, min_new_tokens=args.new_tokens)
    print(f"\n[generate] HFBackend.generate, groups of 4 rows per prompt, exactly {args.new_tokens} new tokens, "
          f"{args.rounds} alternated rounds (+1 warm-up), seed 0 per call")
    for B in args.batches:
        texts = [f"Game {i}: you are playing a bandit game. Two arms: Apple and Stuntman. Each arm pays a random reward. "
                 "Think step by step, then answer inside <answer></answer>. " * 4 for i in range(max(1, B // 4))]
        prompts = [tokenizer(t)["input_ids"][: args.prompt_len] for t in texts for _ in range(4)][:B]
        p0 = peak(torch)
        times, tokens = {a: [] for a in arms}, {}
        for r, arm in alternate(list(arms), args.rounds + 1):
            backend = HFBackend(model, tokenizer, precision="fp32", **arms[arm])
            torch.manual_seed(0)
            gens = backend.generate(prompts, params)
            tokens[arm] = [g.token_ids for g in gens]
            if r > 0:
                times[arm].append(backend.stats.decode_s)
            print(f"    round {r}{' (warm-up)' if r == 0 else ''} {arm}: decode {backend.stats.decode_s:.2f} s, "
                  f"prefill {backend.stats.prefill_s:.2f} s, load {os.getloadavg()[0]:.2f}", flush=True)
        p1 = peak(torch)
        fp32_peak = max(p0, p1)
        generated = sum(len(t) for t in tokens["levers on"])
        same = tokens["levers on"] == tokens["levers off"]
        line = []
        for arm in arms:
            s = statistics.median(times[arm])
            mfu = 2 * n_params * generated / s / (fp32_peak * 1e9)
            line.append(f"{arm} {s:.2f} s ({generated / s:.1f} tok/s, MFU {mfu:.1%})")
        off, on = statistics.median(times["levers off"]), statistics.median(times["levers on"])
        print(f"  batch {B}: " + ", ".join(line) + f"; ratio {off / on:.2f}x; same tokens: {same}; "
              f"fp32 peak {fp32_peak:.1f} GFLOP/s (before {p0:.1f}, after {p1:.1f})", flush=True)


def grouped_prompts(tokenizer, batch: int, lengths_differ: bool = True) -> list[list[int]]:
    """``batch`` prompt rows in groups of 4 sharing a prompt; with ``lengths_differ`` the prompts' lengths differ
    between groups (a padding mask), else all are equally long."""
    words = [14 + (3 * g % 11 if lengths_differ else 0) for g in range(max(1, batch // 4))]
    texts = [f"Game {g}: " + "push the box onto the target. " * w for g, w in enumerate(words)]
    return [tokenizer(t)["input_ids"] for t in texts for _ in range(4)][:batch]


def attention_section(torch, model, tokenizer, args) -> None:
    """``decode_attention`` off/on (:mod:`ragen.models.decode_attention`), at the run's precision, with and without padding."""
    from ragen.models.backend import HFBackend, SamplingParams
    from ragen.models.precision import resolve_precision

    precision = resolve_precision(args.precision)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.8, min_new_tokens=args.new_tokens)
    print(f"\n[attention] HFBackend.generate with decode_attention off/on, {precision}, groups of 4 rows per prompt, "
          f"exactly {args.new_tokens} new tokens, {args.rounds} alternated rounds (+1 warm-up), seed 0 per call")
    for B in args.batches:
        for layout in ("equal lengths (no padding mask)", "lengths differ (padding mask)"):
            prompts = grouped_prompts(tokenizer, B, lengths_differ=layout.startswith("lengths differ"))
            times, tokens = {False: [], True: []}, {}
            for r, on in alternate([False, True], args.rounds + 1):
                backend = HFBackend(model, tokenizer, precision=precision, decode_attention=on, fused_decode=False)
                torch.manual_seed(0)
                tokens[on] = [g.token_ids for g in backend.generate(prompts, params)]
                if r > 0:
                    times[on].append(backend.stats.decode_s)
            off, on = statistics.median(times[False]), statistics.median(times[True])
            same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
            lens = sorted(len(p) for p in prompts)
            print(f"  batch {B}, {layout}, prompts {lens[0]}-{lens[-1]} tokens: decode sdpa {off:.2f} s, "
                  f"decode_attention {on:.2f} s, ratio {off / on:.2f}x; rows with identical tokens {same}/{B}", flush=True)


def fused_section(torch, model, tokenizer, args) -> None:
    """``HFBackend.generate`` with the fused decode step off/on (:mod:`ragen.models.fused_decode`), every other lever on."""
    from ragen.models.backend import HFBackend, SamplingParams
    from ragen.models.precision import resolve_precision

    precision = resolve_precision(args.precision)
    n_params = sum(p.numel() for p in model.parameters())
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.8, min_new_tokens=args.new_tokens)
    print(f"\n[fused] HFBackend.generate with fused_decode off/on, {precision}, groups of 4 rows per prompt (lengths "
          f"differ between groups: a padding mask), exactly {args.new_tokens} new tokens, {args.rounds} alternated rounds "
          f"(+1 warm-up), seed 0 per call; MFU = 2·N·generated tokens / decode seconds / {precision} matmul peak")
    for B in args.batches:
        prompts = grouped_prompts(tokenizer, B)
        p0 = peak(torch, precision)
        times, tokens, steps = {False: [], True: []}, {}, {}
        for r, on in alternate([False, True], args.rounds + 1):
            backend = HFBackend(model, tokenizer, precision=precision, fused_decode=on)
            torch.manual_seed(0)
            tokens[on] = [g.token_ids for g in backend.generate(prompts, params)]
            steps[on] = backend.fused.fused_steps
            if r > 0:
                times[on].append(backend.stats.decode_s)
        top = max(p0, peak(torch, precision))
        generated = sum(len(t) for t in tokens[True])
        off, on = statistics.median(times[False]), statistics.median(times[True])
        same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
        lens = sorted(len(p) for p in prompts)
        mfu = lambda s: 2 * n_params * generated / s / (top * 1e9)  # noqa: E731
        print(f"  batch {B}, prompts {lens[0]}-{lens[-1]} tokens: decode off {off:.2f} s (MFU {mfu(off):.1%}), "
              f"on {on:.2f} s (MFU {mfu(on):.1%}, {steps[True]} fused steps), ratio {off / on:.2f}x; rows with identical "
              f"tokens {same}/{B} (bf16 rounding may change some); {precision} peak {top:.1f} GFLOP/s", flush=True)


def native_section(torch, model, tokenizer, args) -> None:
    """``HFBackend.generate`` with the native (C++) grouped decode step off/on (:mod:`ragen.models.native_decode`)."""
    from ragen.models import native
    from ragen.models.backend import HFBackend, SamplingParams
    from ragen.models.precision import resolve_precision

    precision = resolve_precision(args.precision)
    if native.ops() is None and native.gemm_ops() is None:
        print(f"\n[native] skipped: decode step: {native.unavailable_reason()}; panel GEMM: {native.GEMM.reason}")
        return
    n_params = sum(p.numel() for p in model.parameters())
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.8, min_new_tokens=args.new_tokens)
    print(f"\n[native] HFBackend.generate with native_decode off/on (every other lever on), {precision}, groups of 4 rows "
          f"per prompt (lengths differ between groups), exactly {args.new_tokens} new tokens, {args.rounds} alternated "
          f"rounds (+1 warm-up), seed 0 per call; MFU = 2·N·generated tokens / whole call seconds / {precision} matmul peak")
    for B in args.batches:
        prompts = grouped_prompts(tokenizer, B)
        p0 = peak(torch, precision)
        backends = {on: HFBackend(model, tokenizer, precision=precision, native_decode=on) for on in (False, True)}
        calls, decode, tokens = {False: [], True: []}, {False: [], True: []}, {}
        for r, on in alternate([False, True], args.rounds + 1):
            backend = backends[on]
            d0 = backend.stats.decode_s
            torch.manual_seed(0)
            t0 = time.perf_counter()
            tokens[on] = [g.token_ids for g in backend.generate(prompts, params)]
            if r > 0:
                calls[on].append(time.perf_counter() - t0)
                decode[on].append(backend.stats.decode_s - d0)
        top = max(p0, peak(torch, precision))
        generated = sum(len(t) for t in tokens[True])
        mfu = lambda s: 2 * n_params * generated / s / (top * 1e9)  # noqa: E731
        off, on = statistics.median(calls[False]), statistics.median(calls[True])
        pairs = [a / b for a, b in zip(calls[False], calls[True])]
        same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
        steps = backends[True].fused
        print(f"  batch {B}: whole call off {off:.2f} s (MFU {mfu(off):.1%}), on {on:.2f} s (MFU {mfu(on):.1%}), ratio "
              f"{off / on:.2f}x (per round {' '.join(f'{x:.2f}' for x in pairs)}); decode steps off "
              f"{statistics.median(decode[False]):.2f} s, on {statistics.median(decode[True]):.2f} s; native steps "
              f"{steps.native_steps} of {steps.grouped_steps} grouped; rows with identical tokens {same}/{B} (float "
              f"rounding may change some); {precision} peak {top:.1f} GFLOP/s", flush=True)


# ---------------------------------------------------------------------------- main
def panel_section(torch, model, args) -> None:
    """fp32 linears at decode rows: ``(W @ hᵀ)ᵀ``, oneDNN-packed and ragen's panel GEMM, weights cycled from memory."""
    from ragen.models import native
    from ragen.models.transposed_gemm import transposed_linear

    gemm = native.gemm_ops()
    if gemm is None:
        print(f"\n[panel] skipped: {native.GEMM.reason}")
        return
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear})
    print(f"\n[panel] fp32 linears per shape (out, in) at {args.batches} rows: W@h^T / oneDNN packed / panel GEMM, weights "
          f"cycled from memory, median of {args.rounds} alternated rounds (+1 warm-up)")
    with torch.no_grad():
        for shape in shapes:
            plain = [torch.randn(shape) for _ in range(max(2, -(-(256 << 20) // (shape[0] * shape[1] * 4))))]
            dnn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in plain]
            panels = [gemm.pack_panels(w) for w in plain]
            for M in args.batches:
                h = torch.randn(M, shape[1])
                arms = {
                    "W@h^T": lambda: [transposed_linear(h, w, row_major=False) for w in plain],
                    "oneDNN": lambda: [torch.ops.mkldnn._linear_pointwise(h, w, None, "none", [], "") for w in dnn],
                    "panel": lambda: [gemm.linear_panels(h, p, shape[0], None) for p in panels],
                }
                times = {arm: [] for arm in arms}
                for r, arm in alternate(list(arms), args.rounds + 1):
                    t0 = time.perf_counter()
                    arms[arm]()
                    if r > 0:
                        times[arm].append((time.perf_counter() - t0) / len(plain))
                ms = {arm: med_ms(t) for arm, t in times.items()}
                flops = 2 * M * shape[0] * shape[1]
                best_other = min(ms["W@h^T"], ms["oneDNN"])
                print(f"  {shape} {M:3d} rows: " + ", ".join(f"{a} {v:.3f} ms ({flops / v / 1e6:.0f} GFLOP/s)"
                                                              for a, v in ms.items())
                      + f"; panel {best_other / ms['panel']:.2f}x the faster other", flush=True)
            del plain, dnn, panels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sections", nargs="+", default=["gemm", "steps", "prefill", "generate"],
                    choices=["gemm", "steps", "prefill", "generate", "attention", "fused", "native", "panel"])
    ap.add_argument("--precision", default="auto", help="attention section: trainer.precision (auto: bf16 where the CPU has it)")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--gemm-rows", type=int, nargs="*", default=[128, 256, 1024], help="more row counts (gemm section)")
    ap.add_argument("--update-rows", type=int, nargs="*", default=[128, 512, 1024])
    ap.add_argument("--prompt-len", type=int, default=110)
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=[64, 128, 192, 256, 320])
    ap.add_argument("--prefill-count", type=int, default=5, help="forwards per arm per round (prefill section)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--step-count", type=int, default=8, help="decode steps per arm per round (steps section)")
    ap.add_argument("--rounds", type=int, default=3, help="timed alternated rounds per comparison")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    from ragen.models.loading import load_model

    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"commit {commit or '?'}{' (+ uncommitted changes in the tree)' if dirty else ''}; machine: {machine()}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, torch threads {torch.get_num_threads()}",
          flush=True)
    model, tokenizer = load_model(args.model)
    model.eval()
    whole = Contention()
    for name in args.sections:
        section = Contention()
        if name == "gemm":
            gemm_section(torch, model, args)
        elif name == "steps":
            steps_section(torch, model, tokenizer, args)
        elif name == "prefill":
            prefill_section(torch, model, tokenizer, args)
        elif name == "attention":
            attention_section(torch, model, tokenizer, args)
        elif name == "fused":
            fused_section(torch, model, tokenizer, args)
        elif name == "native":
            native_section(torch, model, tokenizer, args)
        elif name == "panel":
            panel_section(torch, model, args)
        else:
            generate_section(torch, model, tokenizer, args)
        print(f"  ({name}: {section.report()})", flush=True)
    print(f"\nwhole run: {whole.report()}; load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
