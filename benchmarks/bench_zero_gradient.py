"""Update time when every advantage is zero: backward skipped vs the full pass, side by side.

    .venv/bin/python benchmarks/bench_zero_gradient.py                # smollm2-135m, bandit preset, ~3 min
    .venv/bin/python benchmarks/bench_zero_gradient.py --model tiny --repeats 1

The case it measures is SFT -> RL on the bandit (docs/sft.md): the SFT policy pulls the same
arm in every episode, the envs of a group share the payoff draw, so every group's rewards are
equal and GRPO's advantages are exactly 0. One real rollout of the ``bandit`` preset gives the
trajectories; their rewards are then made equal within each group. The same trainer then
runs ``update`` alternately with the zero-gradient path (``gradient_is_zero`` as shipped) and
with it forced off (a full forward + backward that returns zero gradients), ``--repeats``
times each. With AdamW's state empty and no weight decay a zero-gradient step leaves the
weights unchanged, so every repeat updates the same weights.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args()

    import torch

    from ragen.config import load_config
    from ragen.train.trainer import StarPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    out = f"/tmp/bench_zero_gradient-{os.getpid()}"
    trainer = StarPOTrainer(load_config("bandit", [f"model={args.model}", f"trainer.output_dir={out}", "trainer.val_episodes=1",
                                                   "trainer.device=cpu"]))
    trajectories = trainer.rollout(1)
    for t in trajectories:  # every group's rewards equal: GRPO advantages exactly 0
        for turn in t.turns:
            turn.env_reward, turn.format_penalty, turn.think_reward, turn.prediction_reward = float(t.group_id % 2), 0.0, 0.0, 0.0
    shipped = trainer.actor.gradient_is_zero
    times: dict[str, list[float]] = {"backward skipped": [], "full pass": []}
    for _ in range(args.repeats):
        for name, rule in (("backward skipped", shipped), ("full pass", lambda advantages: False)):
            trainer.actor.gradient_is_zero = rule
            start = time.perf_counter()
            metrics = trainer.update(trajectories)
            times[name].append(time.perf_counter() - start)
            assert metrics["actor/grad_norm"] == 0.0
            assert metrics["actor/backward_skipped"] == (1.0 if name == "backward skipped" else 0.0)
    tokens = sum(len(t.input_ids) for t in trajectories)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}, precision {trainer.config.trainer.precision}")
    print(f"model {args.model}: {len(trajectories)} trajectories, {tokens} tokens; {args.repeats} repeats each, alternating")
    for name, values in times.items():
        print(f"  update, {name:16s}: mean {statistics.mean(values):6.2f} s  (min {min(values):.2f}, max {max(values):.2f})")
    ratio = statistics.mean(times["full pass"]) / statistics.mean(times["backward skipped"])
    print(f"  full pass / backward skipped: {ratio:.2f}x")


if __name__ == "__main__":
    main()
