import math

import pytest

from ragen.agent.trajectory import Trajectory, Turn
from ragen.eval.collapse import CollapseMonitor, collapse_signals, normalised_mutual_information


def _traj(group: int, response: str, reward: float) -> Trajectory:
    t = Trajectory(env_name="x", group_id=group, seed=group)
    t.turns = [Turn(response, [], True, reward, 0.0)]
    return t


def test_mutual_information_extremes():
    # Responses identify the prompt exactly: I = H(X).
    assert normalised_mutual_information([(0, "a"), (1, "b"), (0, "a"), (1, "b")]) == pytest.approx(1.0)
    # The same response whatever the prompt (template collapse): I = 0.
    assert normalised_mutual_information([(0, "a"), (1, "a"), (2, "a")]) == 0.0
    # Hand-computed: X uniform on {0,1}; Y = "a" for x=0 twice, x=1 gives "a" and "b".
    # p(a)=3/4, p(b)=1/4; I = 2/4*log2((1/2)/(1/2*3/4)) + 1/4*log2((1/4)/(1/2*3/4)) + 1/4*log2((1/4)/(1/2*1/4))
    pairs = [(0, "a"), (0, "a"), (1, "a"), (1, "b")]
    expected = 0.5 * math.log2(4 / 3) + 0.25 * math.log2(2 / 3) + 0.25 * math.log2(2)
    assert normalised_mutual_information(pairs) == pytest.approx(expected)


def test_signals_separate_diverse_from_collapsed_batches():
    diverse = [_traj(g, f"prompt {g} needs move {g} then {g + 1}", float(i)) for g in range(4) for i in range(2)]
    collapsed = [_traj(g, "I will go Up then Up", 0.0) for g in range(4) for _ in range(2)]
    d, c = collapse_signals(diverse), collapse_signals(collapsed)
    assert d["collapse/in_group_reward_std"] == pytest.approx(0.5) and c["collapse/in_group_reward_std"] == 0.0
    assert c["collapse/cross_prompt_similarity"] == 1.0 > d["collapse/cross_prompt_similarity"]
    assert c["collapse/prompt_response_mi"] == 0.0 and d["collapse/prompt_response_mi"] == pytest.approx(1.0)
    assert c["collapse/distinct_2"] < d["collapse/distinct_2"]


def test_monitor_warns_and_confirms_collapse():
    monitor = CollapseMonitor(patience=2)
    for _ in range(6):
        assert monitor.check({"actor/grad_norm": 1.0, "actor/entropy": 1.0, "collapse/in_group_reward_std": 0.3}) == []
    spike = monitor.check({"actor/grad_norm": 50.0})
    assert spike and "grad norm spike" in spike[0]
    monitor.check({"actor/entropy": 0.01, "collapse/in_group_reward_std": 0.0, "collapse/cross_prompt_similarity": 0.95})
    assert not monitor.collapsed
    warnings = monitor.check({"actor/entropy": 0.01, "collapse/in_group_reward_std": 0.0, "collapse/cross_prompt_similarity": 0.95})
    assert monitor.collapsed and len(warnings) == 3


def test_alike_answers_warn_only_when_they_last():
    """Short action answers to different prompts are often alike for a step (the same opening moves); template
    collapse is answers alike step after step."""
    monitor = CollapseMonitor(patience=3)
    assert monitor.check({"collapse/cross_prompt_similarity": 1.0}) == []
    assert monitor.check({"collapse/cross_prompt_similarity": 0.5}) == []  # the run of alike steps restarts
    assert monitor.check({"collapse/cross_prompt_similarity": 0.95}) == []
    assert monitor.check({"collapse/cross_prompt_similarity": 0.95}) == []
    [warning] = monitor.check({"collapse/cross_prompt_similarity": 0.95})
    assert "template collapse" in warning and "3 steps" in warning


def test_a_resumed_monitor_counts_a_nan_step_as_the_live_one_did():
    # metrics.jsonl stores NaN as null; replayed as "not logged", a NaN step no longer broke the run of collapsed
    # steps, so a resumed run confirmed a collapse the uninterrupted run never would have
    import json

    from ragen.files import strict_dumps

    low = {"actor/entropy": 0.0, "collapse/in_group_reward_std": 0.0}
    nan = {"actor/entropy": math.nan, "collapse/in_group_reward_std": math.nan}
    steps = [low, low, nan, low]
    live = CollapseMonitor(patience=3)
    for metrics in steps:
        live.check(metrics)
    resumed = CollapseMonitor(patience=3)
    resumed.replay(json.loads(strict_dumps(m)) for m in steps[:-1])  # as read back from metrics.jsonl
    resumed.check(steps[-1])
    assert live.collapsed is False and resumed.collapsed is False
    assert resumed._collapse_steps == live._collapse_steps == 1


def test_low_entropy_alone_is_quiet_a_habit_is_not():
    """A policy that settles on one answer per prompt (a one-shot bandit's goal) does not warn; the same entropy with
    the second-listed share pinned at 1 (a position habit) warns after ``patience`` steps and confirms a collapse."""
    settled = CollapseMonitor(habit_metrics=("second_listed",))
    for _ in range(10):
        assert settled.check({"actor/entropy": 0.01, "collapse/in_group_reward_std": 0.3,
                              "train/info_second_listed": 0.55}) == []
    assert not settled.collapsed
    habit = CollapseMonitor(habit_metrics=("second_listed",))
    seen = [habit.check({"actor/entropy": 0.01, "collapse/in_group_reward_std": 0.3, "train/info_second_listed": 1.0})
            for _ in range(3)]
    assert seen[0] == seen[1] == []
    assert any("second_listed share 1.00 for 3 steps" in w for w in seen[2])
    assert any("entropy" in w for w in seen[2]) and habit.collapsed


def _replay(name: str) -> tuple[CollapseMonitor, list[str]]:
    """The monitor over a real run's logged signals (SmolLM2-135M on the bandit preset with group-balanced arm orders,
    bf16): ``bandit_position_habit.jsonl`` ends answering the first-listed arm whatever the names (validation 0.500),
    ``bandit_name_reading.jsonl`` learned the names (validation 0.539 → 0.766)."""
    import json
    from pathlib import Path

    from ragen.envs.registry import habit_metric_names

    monitor = CollapseMonitor(habit_metrics=habit_metric_names())
    warnings = []
    for line in (Path(__file__).parent / "data" / name).read_text().splitlines():
        warnings += monitor.check(json.loads(line))
    return monitor, warnings


def test_the_alarm_fires_on_a_real_collapsed_run_and_stays_quiet_on_a_healthy_one():
    collapsed, fired = _replay("bandit_position_habit.jsonl")
    assert any("second_listed share 0.00" in w for w in fired) and collapsed.collapsed
    healthy, quiet = _replay("bandit_name_reading.jsonl")
    assert quiet == [] and not healthy.collapsed
