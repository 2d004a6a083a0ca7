"""The update's levers side by side: fused AdamW, the hand-written target log-probs, grouped attention.

    .venv/bin/python benchmarks/bench_update.py                 # smollm2-135m, bench_vs_trl's shape, ~2 min
    .venv/bin/python benchmarks/bench_update.py --shape main    # the main job's shape (bandit preset as is)
    .venv/bin/python benchmarks/bench_update.py --model tiny --rounds 1
    .venv/bin/python benchmarks/bench_update.py --shape main --compare layout   # shared-prompt layouts

One real rollout gives the batch: at ``--shape trl`` (default) ``bench_vs_trl.py``'s shape (the
``bandit`` preset, 2 prompts x 8 completions, exactly 64 new tokens, one micro-batch,
``ppo_epochs=1``), at ``--shape main`` the ``bandit`` preset's own (8 groups x 4, answers of at
most 16 tokens, micro-batches of 16). Its rewards are then set to ``i % 3`` so that advantages are
non-zero and every update runs a backward pass. The same trainer then updates on that batch with
two arms, alternated (A B B A ...) for ``--rounds`` rounds after one warm-up round, in
``--precision`` (default ``auto``: bf16 where the CPU has it; fp32 on a CPU without native bf16):

``plain``
    What the update did before the levers: torch's for-loop AdamW (``foreach=False``, the CPU
    default), log-probs and entropy through autograd's log-softmax with the entropy in the graph
    (as ``loss - 0 * entropy`` had it), transformers' ``sdpa`` attention for every call and the
    split shared-prompt layout (prompt pass, then continuations on copied KV caches).
``levers``
    As shipped: fused AdamW (:mod:`ragen.train.optimizer`), :mod:`ragen.train.target_logprobs`
    (entropy as a metric when ``entropy_coeff`` is 0), :mod:`ragen.models.train_attention` and the
    automatic shared-prompt layout (:mod:`ragen.train.packed_groups`).

With ``--compare layout`` the two arms are instead the shared-prompt layouts of
:func:`ragen.train.logprobs.decoder_hidden`, everything else as shipped:

``split``
    The distinct prompts as one batch, their KV cache copied to each row, the continuations as a
    second pass (what the update did before the packed layout).
``auto``
    As shipped: the packed layout (one decoder row per group under a block mask,
    :mod:`ragen.train.packed_groups`) where its cost rule picks it, else ``split``; the script
    prints how many micro-batch passes took which.

Each arm keeps its own optimizer (moments), so both take the same kind of step. Printed: the
command, machine, per-round seconds and the median ratio of same-round pairs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_roofline import Contention  # noqa: E402
from machine import machine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", choices=("trl", "main"), default="trl", help="bench_vs_trl's batch or the main job's")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help="trainer.precision")
    ap.add_argument("--compare", choices=("levers", "layout"), default="levers",
                    help="plain vs shipped update, or the split vs the automatic shared-prompt layout")
    args = ap.parse_args(argv)

    import torch

    import ragen.train.logprobs as logprobs_module
    import ragen.train.actor_update as update_module
    import ragen.train.trainer as trainer_module
    from ragen.config import load_config
    from ragen.models import SamplingParams
    from ragen.train.logprobs import PolicyOutput
    from ragen.train.optimizer import adamw

    torch.set_num_threads(args.threads)
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"machine: {machine()}; torch {torch.__version__}, threads {torch.get_num_threads()}", flush=True)
    shape = ["rollout.env_groups=2", "rollout.group_size=8", "rollout.max_new_tokens=64", "algorithm.ppo_epochs=1",
             "algorithm.mini_batch_size=0", "algorithm.micro_batch_size=16"] if args.shape == "trl" else []
    config = load_config("bandit", [
        f"model={args.model}", "trainer.device=cpu", *shape, "optim.warmup_steps=0",
        f"trainer.precision={args.precision}", f"trainer.output_dir=/tmp/bench_update-{os.getpid()}",
        "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.plot=false", "trainer.save_final=false",
        "trainer.logger=[jsonl]",
    ])
    trainer = trainer_module.StarPOTrainer(config)
    print(f"shape {args.shape}, precision {args.precision} -> {config.trainer.precision}", flush=True)
    r = config.rollout
    if args.shape == "trl":
        trainer.train_rollout.sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, stop=())
        trainer.model.generation_config.min_new_tokens = r.max_new_tokens
    trajectories = trainer.rollout(1)
    for i, t in enumerate(trajectories):
        t.turns[-1].env_reward = float(i % 3)  # non-zero advantages: every update runs its backward pass
    tokens = sum(len(t.input_ids) for t in trajectories)
    print(f"batch: {len(trajectories)} episodes, {tokens} tokens, {sum(t.response_length for t in trajectories)} response tokens")

    shipped_forward = update_module.policy_forward
    shipped_attention = logprobs_module.train_attention_for
    sdpa_only = lambda model, enabled=True: shipped_attention(model, enabled=False)  # noqa: E731

    def entropy_in_graph(*a, **kw):  # the old cost: the entropy's graph hangs off the loss
        kw["entropy_grad"] = True
        kw["prompt_layout"] = "split"  # and the shared prompts' two passes (before the packed layout)
        out = shipped_forward(*a, **kw)
        return PolicyOutput(logprobs=out.logprobs + 0.0 * out.entropy, entropy=out.entropy, values=out.values)

    o = config.optim
    layouts = {"packed": 0, "split": 0}
    shipped_cheaper = logprobs_module.packed_is_cheaper

    def counted_cheaper(*a):
        packed = shipped_cheaper(*a)
        layouts["packed" if packed else "split"] += 1
        return packed

    if args.compare == "levers":
        # arm -> (optimizer, policy_forward, attention switch)
        arms = {
            "plain": (torch.optim.AdamW(trainer.actor.trainable_parameters(), lr=o.lr, betas=tuple(o.betas),
                                        weight_decay=o.weight_decay, foreach=False), entropy_in_graph, sdpa_only),
            "levers": (trainer.actor.optimizer, shipped_forward, shipped_attention),
        }
        assert trainer.actor.optimizer.param_groups[0]["fused"], "the shipped optimizer is expected to be fused here"
    else:
        # the trainer passes the layout its ranks agreed on: this arm overrides it
        split_forward = lambda *a, **kw: shipped_forward(*a, **{**kw, "prompt_layout": "split"})  # noqa: E731
        arms = {
            "split": (adamw(trainer.actor.trainable_parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay),
                      split_forward, shipped_attention),
            "auto": (trainer.actor.optimizer, shipped_forward, shipped_attention),
        }
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    contention = Contention()
    logprobs_module.packed_is_cheaper = counted_cheaper
    try:
        for rnd in range(args.rounds + 1):
            for arm in (list(arms) if rnd % 2 == 0 else list(arms)[::-1]):
                trainer.actor.optimizer, update_module.policy_forward, logprobs_module.train_attention_for = arms[arm]
                layouts.update(packed=0, split=0)
                start = time.perf_counter()
                metrics = trainer.update(trajectories)
                took = time.perf_counter() - start
                assert metrics.get("actor/backward_skipped", 0.0) == 0.0
                if rnd:
                    times[arm].append(took)
                print(f"  round {rnd}{' (warm-up)' if rnd == 0 else ''} {arm}: update {took:.2f} s; auto layout chose "
                      f"packed {layouts['packed']}, split {layouts['split']} times", flush=True)
    finally:
        update_module.policy_forward = shipped_forward
        logprobs_module.train_attention_for = shipped_attention
        logprobs_module.packed_is_cheaper = shipped_cheaper
    if args.compare == "layout":
        split, auto = statistics.median(times["split"]), statistics.median(times["auto"])
        paired = statistics.median(a / b for a, b in zip(times["split"], times["auto"]))
        print(f"update, median of {args.rounds} rounds: split {split:.2f} s, auto {auto:.2f} s: {split / auto:.2f}x "
              f"(median of same-round ratios {paired:.2f}x); {contention.report()}")
        return 0
    plain, levers = statistics.median(times["plain"]), statistics.median(times["levers"])
    paired = statistics.median(a / b for a, b in zip(times["plain"], times["levers"]))
    print(f"update, median of {args.rounds} rounds: plain {plain:.2f} s, levers {levers:.2f} s: {plain / levers:.2f}x "
          f"(median of same-round ratios {paired:.2f}x); {contention.report()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
