"""The draw study's exact gradients (scripts/study_group_draws.py) are what it compares every batch against."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import MAPS

import ragen.envs
from ragen.envs.frozen_lake import policy_success_probability, solve

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "study_group_draws.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("study_group_draws", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
