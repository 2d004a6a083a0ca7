"""``ragen eval`` and the collapse signals on awkward inputs: uneven groups, no groups, infinite gradients, one-word answers."""

from __future__ import annotations

import math

import pytest

from ragen.agent.trajectory import Trajectory, Turn
from ragen.eval.collapse import CollapseMonitor, collapse_signals
from ragen.eval.evaluate import pass_at_k
from ragen.eval.metrics import group_pass_at_k


def _traj(group: int, response: str, reward: float, success: bool = False) -> Trajectory:
    t = Trajectory(env_name="x", group_id=group, seed=group, success=success)
    t.turns = [Turn(response, [], True, reward, 0.0)]
    return t


def test_group_pass_at_k_is_unbiased_when_groups_differ_in_size():
    # Group 0: 1 success in 4 samples; group 1: no success in 2 (e.g. two of its episodes raised).
    # pass@2 of group 0 is 1 - C(3,2)/C(4,2) = 0.5, not 1 (which is its pass@4).
    groups = [_traj(0, "a", 0.0, s) for s in (True, False, False, False)] + [_traj(1, "a", 0.0, False)] * 2
    out = group_pass_at_k(groups, "train")
    assert out == {"train/pass@2": pytest.approx((pass_at_k(4, 1, 2) + 0.0) / 2)} == {"train/pass@2": 0.25}
    # Equal groups are unchanged: the share of groups with a success.
    equal = [_traj(g, "a", 0.0, s) for g, s in [(0, True), (0, False), (1, False), (1, False)]]
    assert group_pass_at_k(equal, "train") == {"train/pass@2": 0.5}


def test_no_in_group_std_without_groups_so_the_monitor_does_not_see_a_collapse():
    # rollout.group_size=1 (e.g. PPO with a critic): every episode is its own group, so there is no in-group
    # reward std to measure; it must not be reported as 0 ("every group agrees"), which the monitor counts as flat.
    singletons = [_traj(g, f"answer {g} is move {g}", float(g % 2)) for g in range(6)]
    signals = collapse_signals(singletons)
    assert "collapse/in_group_reward_std" not in signals
    monitor = CollapseMonitor()
    for _ in range(5):
        warnings = monitor.check({**signals, "actor/entropy": 0.01, "actor/grad_norm": 1.0})
        assert not any("in-group reward std" in w for w in warnings)
    assert not monitor.collapsed
    # With real groups it is still there.
    assert collapse_signals(singletons + [_traj(0, "x", 1.0)])["collapse/in_group_reward_std"] == pytest.approx(0.5)


def test_collapse_is_confirmed_only_when_both_signals_coincide_for_patience_steps():
    # docs/collapse.md: confirmed "when low entropy and zero in-group reward std coincide for `patience` steps".
    # Rewards flat for 3 steps while the entropy is healthy, then one step of low entropy: not (yet) confirmed.
    monitor = CollapseMonitor(patience=3)
    for _ in range(3):
        monitor.check({"actor/entropy": 1.0, "collapse/in_group_reward_std": 0.0})
    monitor.check({"actor/entropy": 0.01, "collapse/in_group_reward_std": 0.0})
    assert not monitor.collapsed
    monitor.check({"actor/entropy": 0.01, "collapse/in_group_reward_std": 0.0})
    assert not monitor.collapsed
    monitor.check({"actor/entropy": 0.01, "collapse/in_group_reward_std": 0.0})
    assert monitor.collapsed  # the third step on which both hold


def test_an_infinite_grad_norm_is_a_spike():
    monitor = CollapseMonitor()
    for _ in range(6):
        assert monitor.check({"actor/grad_norm": 1.0}) == []
    warnings = monitor.check({"actor/grad_norm": math.inf})
    assert warnings and "grad norm spike" in warnings[0]
    assert monitor._grad_norms == [1.0] * 6  # not part of the running median
    assert monitor.check({"actor/grad_norm": 1.0}) == []


def test_sampled_episodes_are_reproducible_from_the_config_seed():
    """Two evaluations of the same config (same ``seed``) sample the same episodes, and leave the caller's RNG alone."""
    import torch

    from ragen.config import load_config
    from ragen.eval.evaluate import evaluate

    overrides = ["model=tiny", "es.val=[{tag: Bandit}]", "trainer.val_episodes=2", "rollout.max_new_tokens=6"]
    config = load_config("bandit", overrides)

    def responses(report):
        return [t["turns"][0]["response"] for t in report["examples"]["sampled"]]

    first = evaluate(config, k=1, n=3, baselines=False)
    state = torch.get_rng_state()
    second = evaluate(config, k=1, n=3, baselines=False)
    assert responses(first) == responses(second)
    assert torch.equal(torch.get_rng_state(), state)


def test_distinct_2_is_left_out_when_no_response_has_a_bigram():
    # Bandit answers are one word ("<answer>Pirate</answer>" with the preset's response prefix): there are no
    # bigrams to count, and 0.0 -- below any real value, which is > 0 -- would read as total repetition.
    answers = [_traj(g, f"<answer>{arm}</answer>", 0.0) for g, arm in enumerate(["Pirate", "Hacker", "Pirate", "Chef"])]
    assert "collapse/distinct_2" not in collapse_signals(answers)
    repeated = [_traj(g, "go up go up", 0.0) for g in range(3)]
    assert collapse_signals(repeated)["collapse/distinct_2"] == pytest.approx(2 / 9)


def test_sampled_env_errors_are_noted(monkeypatch):
    """Sampled episodes that raised leave their seed out of pass@k (fewer than k samples left): the table says so."""
    import importlib

    from ragen.config import load_config

    ev = importlib.import_module("ragen.eval.evaluate")  # `import ragen.eval.evaluate` is the function of that name

    config = load_config("bandit", ["model=tiny", "es.val=[]", "trainer.val_episodes=2"])
    canned = {"greedy": {"episodes": 2.0, "env_errors": 0.0, "success": 0.5},
              "sampled": {"episodes": 3.0, "env_errors": 1.0, "success": 0.0, "k": 2, "n": 2, "pass_at_k": 0.0,
                          "seeds_scored": 1},
              "greedy_examples": [], "sampled_examples": []}
    monkeypatch.setattr(ev, "run_model", lambda *args, **kwargs: canned)
    report = ev.evaluate_target(config, ev.eval_targets(config)[0], None, None, k=2, n=2, baselines=False)
    assert any("1 sampled episode(s) ended with an env error" in note and "1 of 2 seeds" in note
               for note in report["notes"]), report["notes"]
