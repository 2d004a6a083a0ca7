"""Env-reported per-turn numbers (``info["metric/<name>"]``) in :func:`ragen.eval.metrics.episode_metrics`."""

from __future__ import annotations

import pytest

from ragen.agent.trajectory import Trajectory, Turn
from ragen.eval.metrics import episode_metrics


def _episode(*infos: dict, error: str = "") -> Trajectory:
    turns = [Turn(response="", actions=["a"], format_valid=True, env_reward=0.0, format_penalty=0.0, info=dict(i))
             for i in infos]
    return Trajectory(env_name="bandit", group_id=0, seed=0, turns=turns, error=error)


def test_env_metrics_are_averaged_over_the_turns_that_report_them():
    episodes = [
        _episode({"metric/second_listed": 1.0}, {"metric/second_listed": True}),
        _episode({"metric/second_listed": 0}, {"other": 5.0}),  # a turn without it does not count
        _episode({"metric/second_listed": 1.0}, error="env raised"),  # left out, like every other metric
    ]
    out = episode_metrics(episodes, "val/Bandit")
    assert out["val/Bandit/info_second_listed"] == pytest.approx(2 / 3)
    assert "val/Bandit/info_other" not in out and not any(k.endswith("/other") for k in out)


def test_non_numeric_and_unprefixed_info_is_not_a_metric():
    out = episode_metrics([_episode({"metric/arm": "Pirate", "success": True, "high_arm": "Pirate"})], "train")
    assert not [k for k in out if "info_" in k]


def test_a_nan_report_is_left_out():
    out = episode_metrics([_episode({"metric/x": float("nan")}), _episode({"metric/x": 0.5})], "train")
    assert out["train/info_x"] == 0.5


def test_success_carries_its_wilson_interval_and_the_table_prints_it():
    from ragen.eval.intervals import wilson
    from ragen.eval.metrics import format_tag_table

    trajectories = []
    for i in range(10):
        t = Trajectory(env_name="bandit", group_id=i, seed=i, tag="Bandit")
        t.turns = [Turn("<answer>A</answer>", ["A"], True, 1.0, 0.0)]
        t.success = i < 8
        trajectories.append(t)
    m = episode_metrics(trajectories, "val")
    assert m["val/success"] == 0.8
    assert (m["val/success_ci_low"], m["val/success_ci_high"]) == wilson(8, 10) == pytest.approx((0.490, 0.943), abs=1e-3)
    assert "0.49-0.94" in format_tag_table({**m, **{k.replace("val/", "val/Bandit/"): v for k, v in m.items()}}, "val")
