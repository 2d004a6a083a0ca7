"""The draw study's exact gradients (scripts/study_group_draws.py) are what it compares every batch against."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import MAPS

import ragen.envs
from ragen.envs.frozen_lake import policy_success_probability, solve
from tests.scripts.script_module import load_script


@pytest.fixture(scope="module")
def study():
    return load_script("study_group_draws")


@pytest.fixture(scope="module")
def lake():
    env = ragen.envs.make("frozen_lake", is_slippery=True, max_steps=20)
    env.reset(seed=0, options={"map": MAPS["4x4"]})
    return env


def test_lake_value_is_the_policys_success_probability(study, lake):
    """A near-deterministic softmax on the expert's actions has J = the expert's exact success within 20 moves."""
    expert = solve(lake)
    theta = np.zeros((16, 4))
    for s, a in expert.items():
        theta[s, a - 1] = 60.0
    value, _ = study.lake_exact(theta, study.lake_tables(lake), lake.state, 20)
    assert value == pytest.approx(policy_success_probability(lake, 20, expert), abs=1e-9)
    assert 0.1 < value < 1.0


def test_lake_gradient_matches_finite_differences(study, lake):
    tables = study.lake_tables(lake)
    theta = np.random.default_rng(0).normal(size=(16, 4))
    _, grad = study.lake_exact(theta, tables, lake.state, 8)
    h = 1e-6
    for s, a in [(0, 1), (4, 2), (9, 1), (14, 2)]:
        up, down = theta.copy(), theta.copy()
        up[s, a] += h
        down[s, a] -= h
        fd = (study.lake_exact(up, tables, lake.state, 8)[0] - study.lake_exact(down, tables, lake.state, 8)[0]) / (2 * h)
        assert grad[s, a] == pytest.approx(fd, rel=1e-5, abs=1e-10)


def test_bandit_gradient_and_sampled_scores(study):
    cfg = {"high_prob": 0.25, "high_payoff": 1.0, "low_payoff": 0.1}
    theta = 0.3
    j = lambda t: (p := 1 / (1 + math.exp(-t))) * 0.25 + (1 - p) * 0.1  # noqa: E731
    assert study.bandit_exact(theta, cfg) == pytest.approx((j(theta + 1e-6) - j(theta - 1e-6)) / 2e-6, rel=1e-6)
    # the batch plays the real env: the high arm is pulled at rate p(high), each score is d/dtheta log pi
    env = ragen.envs.make("bandit", own_payoff_draw=True)
    rewards, scores = study.bandit_batch(env, np.random.default_rng(0), theta, list(range(200)), 4)
    p = 1 / (1 + math.exp(-theta))
    high = np.isclose(scores, 1 - p)
    assert high.sum() + np.isclose(scores, -p).sum() == 800
    assert abs(high.mean() - p) < 0.06
    assert set(rewards[~high]) == {0.1} and set(rewards[high]) <= {0.0, 1.0}


def test_lake_value_of_a_stochastic_policy_by_forward_propagation(study, lake):
    """J by backward induction equals J by pushing the state distribution forward under the same stochastic policy."""
    theta = np.random.default_rng(1).normal(size=(16, 4))
    tables = study.lake_tables(lake)
    value, _ = study.lake_exact(theta, tables, lake.state, 20)
    T, R, D = (t.numpy() for t in tables)
    pi = np.exp(theta) / np.exp(theta).sum(-1, keepdims=True)
    step = np.einsum("sa,sat->st", pi, T * (1 - D))  # (S, S'): moves that go on
    reach = np.einsum("sa,sat->s", pi, T * R)  # (S,): probability this move reaches the goal
    dist, total = np.eye(16)[lake.state], 0.0
    for _ in range(20):
        total += dist @ reach
        dist = dist @ step
    assert value == pytest.approx(total, abs=1e-12)
    assert 0.0 < value < 0.2


def test_measure_reports_alignment_sign_and_empty_batches(study):
    """A stub batch of two groups of two. Batch 0's groups tie (no gradient); then the one rewarded trajectory's score
    points along the exact gradient, against it, along it, and across it."""
    exact = np.array([2.0, 0.0])
    directions = iter([None, [1.0, 0.0], [-1.0, 0.0], [1.0, 0.0], [0.0, 3.0]])

    def batch(rng, seeds):
        direction = next(directions)
        if direction is None:
            return np.array([1.0, 1.0, 0.0, 0.0]), [np.ones(2)] * 4  # every group tied: zero advantages
        return np.array([1.0, 0.0, 0.0, 0.0]), [np.array(direction), np.zeros(2), np.zeros(2), np.zeros(2)]

    r = study.measure(batch, exact, n_batches=5, groups=2, group_size=2, norm_by_std=False, seed_base=0, policy_seed=0)
    assert r["zero"] == pytest.approx(0.2)
    assert r["up"] == pytest.approx(0.4)  # batches 1 and 3 (across has no projection)
    assert r["cos"] == pytest.approx((0 + 1 - 1 + 1 + 0) / 5)
    assert r["cos_moved"] == pytest.approx((1 - 1 + 1 + 0) / 4)
    # mean-centred advantage 0.5 on the rewarded trajectory, over 4 trajectories: g = 0.125 * direction; proj is
    # g . (exact / |exact|) / |exact|
    assert r["proj"] == pytest.approx((0 + 0.125 - 0.125 + 0.125 + 0) / 2 / 5)
