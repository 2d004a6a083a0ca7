"""ragen vs TRL's ``GRPOTrainer``: seconds per RL step on the same model, prompts and shape.

    /tmp/benchvenv/bin/python benchmarks/bench_vs_trl.py             # fp32, 1 warm-up + 3 timed steps each
    /tmp/benchvenv/bin/python benchmarks/bench_vs_trl.py --bf16      # bf16 autocast in both (slow without native bf16)
    /tmp/benchvenv/bin/python benchmarks/bench_vs_trl.py --allocator kept      # RAGEN_MALLOC=keep's setting for both

The opt-in allocator setting of :mod:`ragen.runtime` is process-wide, so both frameworks run under
the same one: glibc's defaults for both, or with ``--allocator kept`` glibc keeping freed memory
for both (TRL gains from it too).

TRL is not a ragen dependency: run this from a separate venv holding ragen and the ``bench``
extra (``pip install -e '.[bench]'``), never from the project venv (TRL may move transformers).
The extra pins TRL 1.16.0. From 1.15 on, ``GRPOTrainer`` always
computes log-probs with its own chunked LM-head function (on a CPU: torch ops over 32 768-column
vocabulary tiles, every position scored (it skips the prompt's positions only on Triton
devices), logits recomputed in the backward), where 1.13.0 ran the LM head on the completion
positions only (``logits_to_keep``); with 1.16.0 its update took about twice as long here as
with 1.13.0 (that function is the largest change on that path; not isolated further). ``pip install trl==1.13.0`` in the same venv
measures the older release with the same script (the report names the version it ran).

One process, one model (SmolLM2-135M-Instruct, loaded twice from ragen's local cache by
``ragen.models.load_model``: ragen trains one copy, TRL the other), same shape for both:
2 bandit prompts per step, 8 completions each (16 per step), exactly 64 new tokens per
completion (EOS suppressed by ``min_new_tokens``: ragen's ``SamplingParams``, TRL's generation kwargs;
ragen's ``</answer>`` stop string off),
temperature 1.0, AdamW with the same lr / betas / weight decay / grad clip, constant LR,
token-mean clipped PG (TRL: ``loss_type="dapo"``, eps 0.2/0.28), no KL, one optimizer step per
batch of 16, no gradient checkpointing, fp32 (or ``--bf16``). The 135M model does not close ``<answer>`` within 64
forced tokens, so every reward is the format penalty and every advantage is 0: ragen's update would then skip its
backward pass (the gradient is exactly zero; ``StarPOTrainer.gradient_is_zero``), which TRL runs anyway. By default
ragen is made to run it too (the same work in both); ``--zero-gradient-skip`` times ragen as shipped
(its update then skips the backward pass that TRL runs).

The prompts are ragen's: the bandit prompts ragen's own rollout rendered (chat template,
system prompt, ``<answer>`` response prefix) at each of its steps, given to TRL as the
decoded text in the same order, with their seeds; TRL's reward function replays ragen's
per-completion reward work (parse the answer, reset a bandit env with the seed, step it).

Reported per framework: seconds per step (rollout / update split), generated tokens/s,
trained tokens/s, and model-FLOPs utilisation against the matmul peak of the run's precision (fp32 or bf16) measured in the
same run, with 2·N FLOPs per generated token and 6·N per trained token (N = parameters).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

MODEL = "smollm2-135m"


# ---------------------------------------------------------------------------- peak
def matmul_peak(dtype: torch.dtype, size: int = 2048, reps: int = 5) -> float:
    """Best GFLOP/s of ``reps`` (size × size) @ (size × size) matmuls after two warm-ups."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    for _ in range(2):
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


# ---------------------------------------------------------------------------- ragen
def run_ragen(args, out_dir: Path) -> dict:
    from ragen.config import load_config
    from ragen.models import SamplingParams
    from ragen.train.trainer import StarPOTrainer

    precision = "bf16" if args.bf16 else "fp32"
    config = load_config("bandit", [
        "trainer.device=cpu", f"rollout.env_groups={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.new_tokens}", f"rollout.temperature={args.temperature}",
        f"optim.lr={args.lr}", "optim.warmup_steps=0", "algorithm.ppo_epochs=1", "algorithm.mini_batch_size=0",
        f"algorithm.micro_batch_size={args.prompts * args.group}",
        f"trainer.precision={precision}", f"trainer.output_dir={out_dir / 'ragen'}",
        "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.plot=false",
        "trainer.save_final=false", "trainer.logger=[jsonl]", f"seed={args.seed}",
    ])
    trainer = StarPOTrainer(config)
    # Exactly new_tokens per completion: no stop string, EOS suppressed until the length is reached.
    r = config.rollout
    trainer.train_rollout.sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                                    top_p=r.top_p, top_k=r.top_k, stop=(), min_new_tokens=args.new_tokens)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    if args.zero_gradient_skip:
        print("  [ragen] update: backward skipped where every advantage is 0 (as shipped)", flush=True)
    else:
        # The same work as TRL's: at this shape every reward is the format penalty, so every advantage is 0 and ragen
        # would skip the backward pass (exactly zero gradients, ragen/train/actor_update.py gradient_is_zero), which TRL runs.
        trainer.actor.gradient_is_zero = lambda advantages: False
        print("  [ragen] update: full forward + backward always (as TRL)", flush=True)

    steps, prompts = [], []
    for step in range(1, args.warmup + args.steps + 1):
        t0 = time.perf_counter()
        trajs = trainer.rollout(step)
        t1 = time.perf_counter()
        metrics = trainer.update(trajs)
        t2 = time.perf_counter()
        prompt_lens, seen = [], {}
        for t in trajs:
            p = t.loss_mask.index(1)
            prompt_lens.append(p)
            seen.setdefault(t.group_id, (t.input_ids[:p], t.seed))
        prompts.extend(seen[g] for g in sorted(seen))
        gen = sum(t.response_length for t in trajs)
        distinct = sum(len(ids) for ids, _ in seen.values())
        steps.append({
            "step": step, "rollout_s": t1 - t0, "update_s": t2 - t1, "step_s": t2 - t0,
            "generated": gen, "trained": sum(len(t.input_ids) for t in trajs),
            "prompt_len": (min(prompt_lens), max(prompt_lens)),
            "completion_len": (min(t.response_length for t in trajs), max(t.response_length for t in trajs)),
            # decoder tokens the update really runs with shared-prompt KV reuse: each prompt once + all answers
            "update_tokens_processed": distinct + gen if config.trainer.share_prompt_prefix else sum(len(t.input_ids) for t in trajs),
            "loss": metrics.get("actor/loss", float("nan")),
            "reward": float(sum(t.reward for t in trajs) / len(trajs)),
        })
        log_step("ragen", steps[-1], warm=step <= args.warmup)
    del trainer
    gc.collect()
    return {"steps": steps, "prompts": prompts, "n_params": n_params}


# ---------------------------------------------------------------------------- TRL
def bandit_reward_func(enable_think: bool, format_penalty: float, response_prefix: str, name_set: str):
    """ragen's per-completion reward work for one bandit turn: parse, reset the env with the seed, step."""
    import ragen.envs
    from ragen.agent.parser import parse_response

    def bandit_reward(completions, seed, **kwargs):
        rewards = []
        for text, s in zip(completions, seed):
            env = ragen.envs.make("bandit", name_set=name_set)
            env.reset(seed=int(s))
            parsed = parse_response(response_prefix + text, enable_think=enable_think, max_actions=1)
            action = env.parse_action(parsed.actions[0]) if parsed.format_valid and parsed.actions else None
            rewards.append(float(env.step(action)[1]) if action is not None else format_penalty)
        return rewards

    return bandit_reward


def run_trl(args, prompts: list[tuple[list[int], int]], out_dir: Path) -> dict:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ragen.config import load_config
    from ragen.models import load_model

    model, tokenizer = load_model(MODEL, seed=args.seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    texts = [tokenizer.decode(ids) for ids, _ in prompts]
    # TRL tokenizes a text prompt with the tokenizer's plain call: it must give ragen's ids back.
    same = [tokenizer(text)["input_ids"] == ids for text, (ids, _) in zip(texts, prompts)]
    dataset = Dataset.from_dict({"prompt": texts, "seed": [s for _, s in prompts]})
    preset = load_config("bandit")
    reward = bandit_reward_func(preset.agent.enable_think, preset.agent.format_penalty, preset.agent.response_prefix, "train")

    n_steps = args.warmup + args.steps
    cfg = GRPOConfig(
        output_dir=str(out_dir / "trl"), use_cpu=True, use_vllm=False, seed=args.seed, data_seed=args.seed,
        bf16=args.bf16, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens}, temperature=args.temperature, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, optim="adamw_torch",
        beta=0.0, num_iterations=1, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="none",
        max_steps=n_steps, shuffle_dataset=False, dataloader_num_workers=0,
        eval_strategy="no", save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
        log_completions=False,
    )

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            steps.append({"step": len(steps) + 1, "_t0": time.perf_counter()})

        def on_step_end(self, args_, state, control, **kw):
            s = steps[-1]
            s["step_s"] = time.perf_counter() - s.pop("_t0")
            s["update_s"] = s["step_s"] - s["rollout_s"]
            log_step("trl", s, warm=s["step"] <= args.warmup)

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(inputs):
        t0 = time.perf_counter()
        out = generate_and_score(inputs)
        s = steps[-1]
        s["rollout_s"] = time.perf_counter() - t0
        pm, cm = out["prompt_mask"], out["completion_mask"]
        s["generated"] = int(cm.sum())
        s["trained"] = int(pm.sum() + cm.sum())
        s["update_tokens_processed"] = s["trained"]
        s["prompt_len"] = (int(pm.sum(1).min()), int(pm.sum(1).max()))
        s["completion_len"] = (int(cm.sum(1).min()), int(cm.sum(1).max()))
        s["prompt_seeds"] = sorted({int(x) for x in inputs_seeds(inputs)})
        return out

    def inputs_seeds(inputs):
        return [x["seed"] for x in inputs] if isinstance(inputs, list) else []

    trainer._generate_and_score_completions = timed_generate_and_score
    trainer.train()
    del trainer, model
    gc.collect()
    return {"steps": steps, "n_params": n_params, "version": trl.__version__, "same_prompt_ids": all(same)}


# ---------------------------------------------------------------------------- report
def log_step(name: str, s: dict, warm: bool) -> None:
    print(f"  [{name}] step {s['step']}{' (warm-up)' if warm else ''}: {s['step_s']:.2f} s "
          f"(rollout {s['rollout_s']:.2f} s, update {s['update_s']:.2f} s), generated {s.get('generated')} tok, "
          f"prompt len {s.get('prompt_len')}, completion len {s.get('completion_len')}", flush=True)


def summarise(steps: list[dict], warmup: int, n_params: int, peak: float) -> dict:
    timed = steps[warmup:]
    mean = lambda k: statistics.mean(s[k] for s in timed)  # noqa: E731
    gen, trained, roll, upd, step = mean("generated"), mean("trained"), mean("rollout_s"), mean("update_s"), mean("step_s")
    gen_flops, train_flops = 2 * n_params * gen, 6 * n_params * trained
    return {
        "step_s": step, "step_min": min(s["step_s"] for s in timed), "step_max": max(s["step_s"] for s in timed),
        "rollout_s": roll, "update_s": upd, "generated": gen, "trained": trained,
        "processed": mean("update_tokens_processed"),
        "gen_tok_s": gen / roll, "train_tok_s": trained / upd,
        "gen_gflops": gen_flops / roll / 1e9, "train_gflops": train_flops / upd / 1e9,
        "mfu_rollout": gen_flops / roll / 1e9 / peak, "mfu_update": train_flops / upd / 1e9 / peak,
        "mfu_step": (gen_flops + train_flops) / step / 1e9 / peak,
        # the same, counting only the decoder tokens the update really ran (ragen: each shared prompt once)
        "mfu_update_processed": 6 * n_params * mean("update_tokens_processed") / upd / 1e9 / peak,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per framework")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per framework")
    ap.add_argument("--prompts", type=int, default=2, help="distinct prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="exact completion length")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast in both (default fp32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zero-gradient-skip", action="store_true",
                    help="let ragen skip the backward pass when every advantage is 0 (as `ragen train` does); by default "
                         "it runs it, as TRL does: at this shape every reward is the format penalty")
    ap.add_argument("--allocator", choices=["kept", "default"], default="default",
                    help="default: glibc's defaults for both frameworks; kept: glibc keeps freed memory for both "
                         "(ragen/runtime.py, RAGEN_MALLOC=keep; process-wide, so TRL gets it too)")
    args = ap.parse_args(argv)
    from ragen.runtime import allocator_state, keep_freed_memory

    if args.allocator == "kept":
        keep_freed_memory(force=True)

    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}, "
          f"avx512f={'avx512f' in flags} avx512_bf16={'avx512_bf16' in flags} amx_bf16={'amx_bf16' in flags}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"allocator for both frameworks: {allocator_state()}")
    print(f"shape: {args.prompts} prompts x {args.group} completions = {args.prompts * args.group} per step, "
          f"{args.new_tokens} new tokens each, lr {args.lr}, T {args.temperature}, "
          f"{'bf16' if args.bf16 else 'fp32'}, {args.warmup} warm-up + {args.steps} timed steps each", flush=True)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    t_start = time.perf_counter()
    peak_before = matmul_peak(torch.float32)
    peak_dtype = matmul_peak(dtype) if args.bf16 else peak_before
    print(f"matmul peak before (2048^3, best of 5): fp32 {peak_before:.1f} GFLOP/s"
          + (f", bf16 {peak_dtype:.1f} GFLOP/s" if args.bf16 else ""), flush=True)

    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        print("ragen: rollout + update", flush=True)
        ragen = run_ragen(args, Path(tmp))
        print("TRL GRPOTrainer", flush=True)
        trl_res = run_trl(args, ragen["prompts"], Path(tmp))
    peak_after = matmul_peak(torch.float32)
    print(f"matmul peak after: fp32 {peak_after:.1f} GFLOP/s", flush=True)
    peak = max(peak_before, peak_after) if not args.bf16 else peak_dtype
    n = ragen["n_params"]
    assert trl_res["n_params"] == n
    a = summarise(ragen["steps"], args.warmup, n, peak)
    b = summarise(trl_res["steps"], args.warmup, n, peak)

    print()
    print(f"N = {n / 1e6:.1f} M parameters; peak used for MFU = {peak:.1f} GFLOP/s "
          f"({'bf16' if args.bf16 else 'fp32'} matmul, best of before/after); TRL {trl_res['version']}; "
          f"TRL got ragen's prompt ids back from the text: {trl_res['same_prompt_ids']}")
    cols = [("s/step (mean)", "step_s", "{:.2f}"), ("min-max", None, None), ("rollout s", "rollout_s", "{:.2f}"),
            ("update s", "update_s", "{:.2f}"), ("gen tok/step", "generated", "{:.0f}"),
            ("trained tok/step", "trained", "{:.0f}"), ("gen tok/s", "gen_tok_s", "{:.1f}"),
            ("trained tok/s", "train_tok_s", "{:.1f}"), ("MFU rollout", "mfu_rollout", "{:.1%}"),
            ("MFU update", "mfu_update", "{:.1%}"), ("MFU step", "mfu_step", "{:.1%}"),
            ("update tok processed", "processed", "{:.0f}"), ("MFU update (processed)", "mfu_update_processed", "{:.1%}")]
    header = "| framework | " + " | ".join(c[0] for c in cols) + " |"
    print(header)
    print("|" + "---|" * (len(cols) + 1))
    for name, r in (("ragen", a), (f"TRL {trl_res['version']} GRPOTrainer", b)):
        cells = [f"{r['step_min']:.1f}-{r['step_max']:.1f}" if key is None else fmt.format(r[key]) for _, key, fmt in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    print(f"TRL / ragen seconds per step: {b['step_s'] / a['step_s']:.2f}x  "
          f"(rollout {b['rollout_s'] / a['rollout_s']:.2f}x, update {b['update_s'] / a['update_s']:.2f}x)")
    print(f"total benchmark wall time: {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
