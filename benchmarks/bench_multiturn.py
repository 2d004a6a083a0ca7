"""Multi-turn rollout: history re-encoding with and without KV caches kept between turns.

    .venv/bin/python benchmarks/bench_multiturn.py                               # 64 Sokoban envs x 5 turns, embedded model
    .venv/bin/python benchmarks/bench_multiturn.py --model tiny --groups 4        # smoke run (seconds)
    .venv/bin/python benchmarks/bench_multiturn.py --kv-max-gb 0.1                # + an arm with a kept-cache budget

Both arms build a real :class:`StarPOTrainer` from the ``sokoban`` preset (SimpleSokoban,
``context_mode=full``) with the same seed, and time one ``trainer.rollout(1)``: every
episode's turns are batched into one ``generate`` call per turn. Only ``rollout.reuse_kv``
differs. With the same seed both arms sample the same tokens (checked and printed), so they
do the same work and the difference is the history prefill alone.

Reported per arm, from the backend's counters (``HFBackend.stats``): rollout seconds,
generated tokens/s, prompt tokens prefilled and reused, prefill seconds (the forward over
the prompt before sampling) and decode seconds (``generate``). "History" tokens are prompt
tokens the same episode had already put through the model in an earlier turn (its earlier
prompts and replies); their time is the prefill time in proportion to their share of the
prefilled tokens. For the kept arms also: the most bytes of kept caches held at once between
turns and how many rows' caches a budget (``rollout.reuse_kv_max_gb``) refused.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from machine import machine  # noqa: E402  (benchmarks/machine.py, next to this script)


def history_tokens(trajectories) -> int:
    """Prompt tokens of turns 2.. that were already in the episode's previous turn (its prompt and reply).

    Turn ``k``'s prompt is ``sequence[:start_k]`` and it begins with turn ``k-1``'s prompt and reply,
    ``sequence[:end_{k-1}]``.
    """
    return sum(end for traj in trajectories for (_, end) in traj.turn_spans[:-1])


def run_arm(reuse_kv: bool, args, max_gb: float | None = None) -> dict:
    from ragen.config import load_config
    from ragen.train.trainer import StarPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config("sokoban", [
            "trainer.device=cpu", f"model={args.model}", f"rollout.env_groups={args.groups}", f"rollout.group_size={args.group_size}",
            f"agent.max_turn={args.turns}", f"agent.max_actions_per_traj={2 * args.turns}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.batch_size={args.groups * args.group_size}",
            f"rollout.reuse_kv={str(reuse_kv).lower()}", f"trainer.num_threads={args.threads}",
            *([f"rollout.reuse_kv_max_gb={max_gb}"] if max_gb is not None else []), f"trainer.precision={args.precision}",
            "trainer.progress_bar=false", f"trainer.output_dir={tmp}/run",
        ])
        trainer = StarPOTrainer(config)
        stats = trainer.backend.stats
        # common-prefix tokens saved by turn 1's call (no history there): the later turns' savings are history not re-run
        first_call, real_generate = [], trainer.backend.generate
        def generate(*a, **k):
            out = real_generate(*a, **k)
            if not first_call:
                first_call.append(stats.common_saved_tokens)
            return out
        trainer.backend.generate = generate
        start = time.perf_counter()
        trajectories = trainer.rollout(1)
        rollout_s = time.perf_counter() - start
        kept = trainer.backend.prefix_cache
        budget = config.rollout.reuse_kv_max_gb
        del trainer
        gc.collect()
    generated = sum(t.response_length for t in trajectories)
    history = history_tokens(trajectories)
    # Of the prompt tokens prefilled this rollout, those already seen by the episode's earlier turns: neither read from
    # a kept cache nor, in turns 2+, run once for the whole call as the prompts' common prefix (HFBackend._common_prefill)
    history_prefilled = history - stats.reused_tokens - (stats.common_saved_tokens - (first_call[0] if first_call else 0))
    return {
        "arm": (f"kept KV caches, {budget:g} GB budget" if reuse_kv else "re-encode history"),
        "kept_peak_mb": kept.peak_nbytes / 2**20 if kept is not None else 0.0,
        "refused": kept.refused if kept is not None else 0,
        "rollout_s": rollout_s, "generated": generated, "turns": sum(len(t.turns) for t in trajectories),
        "prefilled": stats.prefilled_tokens, "reused": stats.reused_tokens, "history_prefilled": history_prefilled,
        "prefill_s": stats.prefill_s, "decode_s": stats.decode_s, "weights_s": stats.weights_s,
        "history_s": stats.prefill_s * history_prefilled / max(stats.prefilled_tokens, 1),
        "ids": [t.input_ids for t in trajectories],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (embedded) or tiny")
    p.add_argument("--groups", type=int, default=16, help="rollout.env_groups")
    p.add_argument("--group-size", type=int, default=4, help="rollout.group_size")
    p.add_argument("--turns", type=int, default=5, help="agent.max_turn")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2, help="trainer.num_threads")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help="trainer.precision")
    p.add_argument("--kv-max-gb", type=float, default=None,
                   help="also run a kept-caches arm with this rollout.reuse_kv_max_gb (the others use the default)")
    args = p.parse_args(argv)

    import torch
    import transformers

    print(f"machine: {machine()}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"settings: model={args.model} sokoban (6x6, 1 box, context_mode=full) {args.groups}x{args.group_size} envs, "
          f"{args.turns} turns, max_new_tokens={args.max_new_tokens}, temperature 1.0, threads={args.threads}, "
          f"precision {args.precision}")
    arms = [run_arm(False, args), run_arm(True, args)]
    if args.kv_max_gb is not None:
        arms.append(run_arm(True, args, args.kv_max_gb))
    same = arms[1]["ids"] == arms[0]["ids"]

    print()
    print("| arm | rollout s | turns played | generated tok/s | prompt tokens prefilled | reused from kept caches "
          "| prefill s | decode s | fused weights build s | history re-encoded: tokens | history re-encoding: s (share of rollout) "
          "| kept caches, most at once | caches refused by the budget |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for a in arms:
        print(f"| {a['arm']} | {a['rollout_s']:.1f} | {a['turns']} | {a['generated'] / a['rollout_s']:.1f} | "
              f"{a['prefilled']:,} | {a['reused']:,} | {a['prefill_s']:.1f} | {a['decode_s']:.1f} | {a['weights_s']:.2f} | "
              f"{a['history_prefilled']:,} | {a['history_s']:.1f} ({100 * a['history_s'] / a['rollout_s']:.1f} %) | "
              f"{a['kept_peak_mb']:,.0f} MB | {a['refused']} |")
    print()
    print(f"rollout speed-up from kept caches: {arms[0]['rollout_s'] / arms[1]['rollout_s']:.2f}x; "
          f"same sampled tokens in both arms: {same} (fp32 only: under bf16 a split prefill rounds differently)")
    if len(arms) > 2:
        print(f"budget arm: same sampled tokens as re-encoding: {arms[2]['ids'] == arms[0]['ids']} (once the budget "
              f"refuses a row, rows run in another batch order and a sampled run draws other random numbers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
