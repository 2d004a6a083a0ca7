"""Episode-level metrics over a list of trajectories (shared by training and validation), overall and per env tag."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from ragen.agent.trajectory import Trajectory
from ragen.envs.base import ENV_METRIC_PREFIX
from ragen.eval.intervals import wilson


def episode_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """Success, rewards, action validity/effectiveness, lengths and group pass@k of ``trajectories``.

    * ``success`` -- share of episodes the env called a success (shaped rewards never count), with its 95 % Wilson
      interval ``success_ci_low`` .. ``success_ci_high`` (:func:`ragen.eval.intervals.wilson`);
    * ``reward_mean`` / ``reward_std`` -- the *task* return (env rewards + format penalties);
    * ``reward_think`` / ``reward_prediction`` -- mean shaped reasoning reward per episode
      (:mod:`ragen.agent.rewards`), logged apart from the task reward; ``prediction_accuracy``
      -- share of scored turns whose ``<prediction>`` was exact (when predictions were asked for);
    * ``format_valid`` = ``valid_action_rate`` -- share of turns whose answer parsed into valid actions;
    * ``effective_action_rate`` -- share of executed actions that changed the env's state;
    * ``actions_per_episode``, ``turns_per_episode``, ``response_length`` (model tokens per turn);
    * ``pass@k`` -- with groups of ``k >= 2`` episodes sharing a seed (training groups): share of
      groups with at least one success (the unbiased pass@k with n = k).
    * ``info_<name>`` -- an env's own per-turn number: the mean of ``info["metric/<name>"]`` (a finite bool, int or
      float) over the turns whose ``step`` reported it, a turn counting the value of its last step that did (a turn
      whose answer did not parse steps nothing; :data:`ENV_METRIC_PREFIX`; Bandit's ``info_second_listed``).

    Episodes whose env raised are counted in ``{prefix}/env_errors`` and left out of the rest;
    ``context_full`` is the share that ended early because a prompt would not fit the model's context.
    """
    ok = [t for t in trajectories if not t.error]
    turns = [turn for t in ok for turn in t.turns]
    rewards = [t.task_reward for t in ok]
    out = {
        f"{prefix}/episodes": float(len(ok)),
        f"{prefix}/env_errors": float(len(trajectories) - len(ok)),
    }
    if not ok:
        return out
    executed = sum(turn.actions_executed for turn in turns)
    valid = sum(turn.format_valid for turn in turns) / max(1, len(turns))
    successes = sum(bool(t.success) for t in ok)
    low, high = wilson(successes, len(ok))
    out.update(
        {
            f"{prefix}/success": successes / len(ok),
            f"{prefix}/success_ci_low": low,
            f"{prefix}/success_ci_high": high,
            f"{prefix}/reward_mean": statistics.fmean(rewards),
            f"{prefix}/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            f"{prefix}/reward_think": sum(turn.think_reward for turn in turns) / len(ok),
            f"{prefix}/reward_prediction": sum(turn.prediction_reward for turn in turns) / len(ok),
            f"{prefix}/format_valid": valid,
            f"{prefix}/valid_action_rate": valid,
            f"{prefix}/effective_action_rate": sum(turn.actions_effective for turn in turns) / executed if executed else 0.0,
            f"{prefix}/turns_per_episode": len(turns) / len(ok),
            f"{prefix}/context_full": sum(bool(t.context_full) for t in ok) / len(ok),
            f"{prefix}/actions_per_episode": sum(t.num_actions for t in ok) / len(ok),
            f"{prefix}/response_length": sum(t.response_length for t in ok) / max(1, len(turns)),
        }
    )
    reported: dict[str, list[float]] = defaultdict(list)  # an env's own numbers, by name
    for turn in turns:
        for key, value in turn.info.items():
            if key.startswith(ENV_METRIC_PREFIX) and isinstance(value, (bool, int, float)) and math.isfinite(value):
                reported[key[len(ENV_METRIC_PREFIX) :]].append(float(value))
    out.update({f"{prefix}/info_{name}": statistics.fmean(values) for name, values in sorted(reported.items())})
    scored = [turn.prediction_correct for turn in turns if turn.prediction_correct is not None]
    if scored:
        out[f"{prefix}/prediction_accuracy"] = sum(scored) / len(scored)
    out.update(group_pass_at_k(ok, prefix))
    return out


def group_pass_at_k(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """``{prefix}/pass@k``: mean over groups (same ``group_id``) of the unbiased pass@k, when all groups have k >= 2 members.

    A group of n members with c successes scores 1 − C(n−c, k)/C(n, k) (Chen et al. 2021): with n = k
    (training groups) 1 if any member succeeded, else 0, so the metric is the share of groups with a
    success. Groups of unequal size (e.g. after an env error) use the smallest size as k; a larger
    group is scored by the same estimator with its own n, not by "any of its n members succeeded"
    (that would be its pass@n).
    """
    groups: dict[int, list[bool]] = defaultdict(list)
    for t in trajectories:
        groups[t.group_id].append(bool(t.success))
    k = min((len(g) for g in groups.values()), default=0)
    if k < 2:
        return {}
    scores = [1.0 - math.comb(len(g) - sum(g), k) / math.comb(len(g), k) for g in groups.values()]
    return {f"{prefix}/pass@{k}": sum(scores) / len(groups)}


def tag_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """:func:`episode_metrics` over everything (``{prefix}/…``) and per env tag (``{prefix}/{tag}/…``)."""
    out = episode_metrics(trajectories, prefix)
    by_tag: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_tag[t.tag or t.env_name].append(t)
    for tag, group in by_tag.items():
        out.update(episode_metrics(group, f"{prefix}/{tag}"))
    return out


def tags_in(metrics: dict[str, float], prefix: str) -> list[str]:
    """The tags that have ``{prefix}/{tag}/episodes`` in ``metrics``, in insertion order."""
    start, end = f"{prefix}/", "/episodes"
    return [k[len(start) : -len(end)] for k in metrics if k.startswith(start) and k.endswith(end) and k.count("/") == 2]


#: Columns of the console table: (metric, header).
TABLE_COLUMNS = (
    ("episodes", "episodes"), ("success", "success"), ("success_ci", "95% CI"), ("reward_mean", "reward"),
    ("valid_action_rate", "valid"),
    ("effective_action_rate", "effective"), ("actions_per_episode", "actions"), ("response_length", "resp_len"),
)


def format_tag_table(metrics: dict[str, float], prefix: str) -> str:
    """A fixed-width table with one row per tag (and ``all``) of the ``{prefix}/{tag}/…`` metrics."""
    rows = [(tag, f"{prefix}/{tag}/") for tag in tags_in(metrics, prefix)] + [("all", f"{prefix}/")]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'tag':<{width}}  " + "  ".join(f"{h:>{11 if key == 'success_ci' else 9}}" for key, h in TABLE_COLUMNS)]
    for name, start in rows:
        cells = []
        for key, _ in TABLE_COLUMNS:
            if key == "success_ci":
                low, high = metrics.get(start + "success_ci_low"), metrics.get(start + "success_ci_high")
                cells.append(f"{'-':>11}" if low is None or high is None else f"{low:.2f}-{high:.2f}".rjust(11))
                continue
            value = metrics.get(start + key)
            cells.append(f"{'-':>9}" if value is None else (f"{value:>9.0f}" if key == "episodes" else f"{value:>9.3f}"))
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)
