"""The map-blind baselines (scripts/fixed_answer_baseline.py): the blind-sequence search is exhaustive and exact."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from ragen.envs.agents import Agent, evaluate_agent
from tests.scripts.script_module import SCRIPTS, load_script

SCRIPT = SCRIPTS / "fixed_answer_baseline.py"


@pytest.fixture(scope="module")
def baseline():
    return load_script("fixed_answer_baseline")


class SequenceAgent(Agent):
    """Plays one fixed action sequence, one action a turn, whatever the observation."""

    name = "sequence"

    def __init__(self, names: list[str]):
        self.names = names
        self.turn = 0

    def begin_episode(self, env, seed, budget=None) -> None:
        self.turn = 0

    def act(self, env) -> list[str]:
        name = self.names[min(self.turn, len(self.names) - 1)]
        self.turn += 1
        return [name]


def wins_through_the_env(sequence: list[str], seeds: list[int], config: dict) -> int:
    played = evaluate_agent("frozen_lake", config, SequenceAgent(sequence), seeds, max_turns=len(sequence),
                            max_actions_per_turn=1)
    return round(played["success"] * played["episodes"])


def test_the_blind_search_finds_the_best_sequence_that_brute_force_through_the_env_finds(baseline):
    config = {"size": 3, "is_slippery": False}
    seeds = list(range(12))
    names = {1: "Left", 2: "Down", 3: "Right", 4: "Up"}
    wins, sequence = baseline.best_blind_sequence("frozen_lake", config, seeds, budget=4)
    brute = max(wins_through_the_env([names[a] for a in seq], seeds, config)
                for length in range(1, 5) for seq in itertools.product(names, repeat=length))
    assert wins == brute > 0
    assert wins_through_the_env([names[a] for a in sequence], seeds, config) == wins
    # the shortest of the best: no shorter sequence reaches as many goals
    assert all(wins_through_the_env([names[a] for a in seq], seeds, config) < wins
               for length in range(1, len(sequence)) for seq in itertools.product(names, repeat=length))


def test_the_blind_search_refuses_slippery_ice(baseline):
    with pytest.raises(ValueError, match="deterministic"):
        baseline.best_blind_sequence("frozen_lake", {"size": 3, "is_slippery": True}, [0], budget=2)


def test_an_unknown_preset_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, str(SCRIPT), "no_such_preset"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no_such_preset" in done.stderr


def test_no_episodes_is_a_usage_error_not_a_traceback():
    done = subprocess.run([sys.executable, str(SCRIPT), "frozenlake_rl", "--episodes", "0"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "--episodes" in done.stderr and "Traceback" not in done.stderr
