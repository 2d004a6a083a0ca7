"""Shared or own draws within a group: which gives GRPO the better gradient? A tabular study, no language model.

The envs of a group share a seed, so a start state. What happens after the start (Bandit's payoff, FrozenLake's
slips) is by default drawn from that seed too, so a group's envs also share their luck; ``own_payoff_draw`` /
``own_slip_draw`` give each member its own draw instead (``ragen.envs.base.after_start_rng``). This script measures
what that choice does to one batch's GRPO gradient, on a policy simple enough that the exact policy gradient is known:

* **bandit**: ``pi(high arm) = sigmoid(theta)``; ``J = p * high_prob * high_payoff + (1 - p) * low_payoff`` and
  ``dJ/dtheta = p (1 - p) (high_prob * high_payoff - low_payoff)``;
* **frozen_lake**: a softmax table ``theta[s, a]`` on gymnasium's 4x4 map with slippery ice and ``max_steps`` moves;
  ``J`` (the probability of reaching the goal within the moves) by backward induction over gymnasium's ``P`` in
  torch, and its gradient by autograd.

Episodes are played on the real envs (``ragen.envs.make``), each group on its own seed, member ``j`` reset with
``options={"group_member": j}`` as the rollout does. The batch gradient is the REINFORCE form of GRPO's loss at the
sampling policy: ``g = (1/N) sum_i A_i sum_t grad log pi(a_t | s_t)``, ``A_i`` from
``ragen.algos.advantages.group_normalized_scores`` (mean-centred, or also divided by the group's std). Reported per
setting, over ``--batches`` independent batches:

* ``cos``: mean cosine between one batch's ``g`` and the exact gradient, a batch without a gradient counting 0 (1 =
  every batch parallel to the exact gradient); ``cos|g``: the same over the batches that have a gradient;
* ``sign+``: the fraction of batches whose step has a positive projection on the exact gradient (printed for the
  bandit, where that means the step raises ``p(high)``);
* ``zero``: the fraction of batches with no gradient at all (every group's rewards tied);
* ``proj``: the mean projection of ``g`` onto the exact gradient's direction over its norm (unbiasedness check: the
  draws change the noise, not the mean, so with mean-centring both modes should agree up to sampling error).

    .venv/bin/python scripts/study_group_draws.py [--batches 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
from gymnasium.envs.toy_text.frozen_lake import MAPS

import ragen.envs
from ragen.envs.frozen_lake import solve
from ragen.algos.advantages import group_normalized_scores

EPS = 1e-6  # AdvantageInputs.eps


def advantages(rewards: np.ndarray, group_size: int, norm_by_std: bool) -> np.ndarray:
    """GRPO's per-trajectory advantage for ``rewards`` (N,), laid out group after group."""
    scores = torch.as_tensor(rewards, dtype=torch.float64)
    keys = torch.arange(len(rewards)) // group_size
    return group_normalized_scores(scores, keys, norm_by_std, EPS).numpy()


# --------------------------------------------------------------------------------------------------- bandit


def bandit_exact(theta: float, cfg: dict) -> float:
    p = 1.0 / (1.0 + math.exp(-theta))
    return p * (1 - p) * (cfg["high_prob"] * cfg["high_payoff"] - cfg["low_payoff"])


def bandit_batch(env, rng: np.random.Generator, theta: float, seeds: list[int], group_size: int) -> tuple[np.ndarray, list]:
    """One batch: rewards (N,) and per trajectory the score function d log pi / d theta (a float)."""
    p = 1.0 / (1.0 + math.exp(-theta))
    rewards, scores = [], []
    for seed in seeds:
        for member in range(group_size):
            env.reset(seed=seed, options={"group_member": member})
            high = bool(rng.random() < p)
            _, reward, *_ = env.step(env.high_action if high else 3 - env.high_action)
            rewards.append(reward)
            scores.append((1.0 - p) if high else -p)  # d/dtheta log sigmoid(+-theta)
    return np.array(rewards), scores


# --------------------------------------------------------------------------------------------------- frozen lake


def lake_tables(env) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gymnasium's ``P`` as dense (S, A, S') tensors: transition probability, reward, and whether the move ends it."""
    P = env.lake.P
    n_s, n_a = len(P), len(P[0])
    T, R, D = (torch.zeros(n_s, n_a, n_s, dtype=torch.float64) for _ in range(3))
    for s in range(n_s):
        for a in range(n_a):
            for prob, s2, reward, done in P[s][a]:
                T[s, a, s2] += prob
                R[s, a, s2] = reward
                D[s, a, s2] = float(done)
    return T, R, D


def lake_exact(theta: np.ndarray, tables, start: int, horizon: int) -> tuple[float, np.ndarray]:
    """``J`` = P(goal within ``horizon`` moves) under softmax(theta) (S, A), and ``dJ/dtheta`` (S, A) by autograd."""
    T, R, D = tables
    th = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    pi = th.softmax(-1)  # (S, A)
    value = torch.zeros(T.shape[0], dtype=torch.float64)  # (S,) with 0 moves left
    for _ in range(horizon):
        q = (T * (R + (1 - D) * value)).sum(-1)  # (S, A)
        value = (pi * q).sum(-1)
    value[start].backward()
    return float(value[start].detach()), th.grad.numpy()


def lake_batch(env, rng: np.random.Generator, theta: np.ndarray, seeds: list[int], group_size: int, lake_map: list[str]):
    """One batch: rewards (N,) and per trajectory its score function sum_t grad log pi(a_t|s_t) (S, A)."""
    pi = np.exp(theta - theta.max(-1, keepdims=True))
    pi /= pi.sum(-1, keepdims=True)
    rewards, scores = [], []
    for seed in seeds:
        for member in range(group_size):
            env.reset(seed=seed, options={"map": lake_map, "group_member": member})
            score = np.zeros_like(theta)
            total, done = 0.0, False
            while not done:
                s = env.state
                a = int(rng.choice(4, p=pi[s]))
                score[s] -= pi[s]
                score[s, a] += 1.0
                _, reward, terminated, truncated, _ = env.step(a + 1)  # ragen ids are gymnasium's + 1
                total += reward
                done = terminated or truncated
            rewards.append(total)
            scores.append(score)
    return np.array(rewards), scores


# --------------------------------------------------------------------------------------------------- study


def measure(batch_fn, exact: np.ndarray, n_batches: int, groups: int, group_size: int, norm_by_std: bool,
            seed_base: int, policy_seed: int) -> dict:
    rng = np.random.default_rng(policy_seed)
    unit = exact.ravel() / np.linalg.norm(exact)
    cos, moved, proj, zero, up = [], [], [], 0, 0  # cos: 0 for a batch without a gradient; moved: only the others
    for b in range(n_batches):
        seeds = [seed_base + b * groups + g for g in range(groups)]
        rewards, scores = batch_fn(rng, seeds)
        adv = advantages(rewards, group_size, norm_by_std)
        g = sum(a * np.ravel(s) for a, s in zip(adv, scores)) / len(adv)
        norm = np.linalg.norm(g)
        zero += norm == 0
        up += float(g @ unit) > 0
        cos.append(float(g @ unit / norm) if norm > 0 else 0.0)
        if norm > 0:
            moved.append(cos[-1])
        proj.append(float(g @ unit) / np.linalg.norm(exact))
    se = lambda x: np.std(x) / math.sqrt(len(x))  # noqa: E731
    return {"cos": np.mean(cos), "cos_se": se(cos), "cos_moved": np.mean(moved) if moved else 0.0,
            "cos_moved_se": se(moved) if moved else 0.0, "proj": np.mean(proj), "proj_se": se(proj),
            "zero": zero / n_batches, "up": up / n_batches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=2000, help="independent batches per setting")
    ap.add_argument("--seed", type=int, default=0, help="seeds the policy's sampling; env seeds follow from it")
    ap.add_argument("--horizon", type=int, default=20, help="FrozenLake max_steps (the slippery study's 20 turns)")
    args = ap.parse_args()
    print(f"study_group_draws: --batches {args.batches} --seed {args.seed} --horizon {args.horizon}")

    # Bandit: the main job's batch (8 groups x 4), its config's payoffs.
    groups, size = 8, 4
    for own in (False, True):
        env = ragen.envs.make("bandit", own_payoff_draw=own)
        cfg = {k: getattr(env.config, k) for k in ("high_prob", "high_payoff", "low_payoff")}
        for p_high in (0.2, 0.5, 0.8):
            theta = math.log(p_high / (1 - p_high))
            exact = np.array([bandit_exact(theta, cfg)])
            for norm in (False, True):
                start = time.perf_counter()
                r = measure(lambda rng, seeds: bandit_batch(env, rng, theta, seeds, size), exact, args.batches,
                            groups, size, norm, seed_base=10_000 * args.seed, policy_seed=args.seed)
                print(f"bandit      {'own   ' if own else 'shared'} p(high)={p_high:.1f} std={'on ' if norm else 'off'} "
                      f"sign+ {r['up']:.3f}  zero {r['zero']:.3f}  proj {r['proj']:.3f}±{r['proj_se']:.3f}  "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)

    # FrozenLake: the slippery study's batch (4 groups x 4), gymnasium's 4x4 map.
    groups, size = 4, 4
    lake_map = MAPS["4x4"]
    for own in (False, True):
        env = ragen.envs.make("frozen_lake", is_slippery=True, max_steps=args.horizon, own_slip_draw=own)
        env.reset(seed=0, options={"map": lake_map})
        tables, start_state = lake_tables(env), env.state
        expert = solve(env)
        for strength in (0.0, 2.0, 4.0):
            theta = np.zeros((16, 4))
            for s, a in expert.items():
                theta[s, a - 1] = strength
            value, exact = lake_exact(theta, tables, start_state, args.horizon)
            for norm in (False, True):
                start = time.perf_counter()
                r = measure(lambda rng, seeds: lake_batch(env, rng, theta, seeds, size, lake_map), exact,
                            args.batches, groups, size, norm, seed_base=10_000 * args.seed, policy_seed=args.seed)
                print(f"frozen_lake {'own   ' if own else 'shared'} expert+{strength:.0f} (J={value:.3f}) "
                      f"std={'on ' if norm else 'off'} cos {r['cos']:.3f}±{r['cos_se']:.3f}  "
                      f"cos|g {r['cos_moved']:.3f}±{r['cos_moved_se']:.3f}  zero {r['zero']:.3f}  "
                      f"proj {r['proj']:.3f}±{r['proj_se']:.3f}  ({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
