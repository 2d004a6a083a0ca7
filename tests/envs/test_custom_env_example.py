"""examples/custom_env.py: a user env registers without editing ragen, passes check_env, and trains."""

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from gymnasium.utils.env_checker import check_env

import ragen.envs
from ragen.cli import main
from ragen.envs.agents import ExpertAgent, RandomAgent, evaluate_agent
from ragen.agent.play import play

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_env.py"


@pytest.fixture(scope="module")
def example():
    if "guess_number" in ragen.envs.registered():  # already imported by another test module
        return sys.modules["ragen_example_custom_env"]
    spec = importlib.util.spec_from_file_location("ragen_example_custom_env", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_registers_and_passes_check_env(example):
    assert ragen.envs.registered()["guess_number"] is example.GuessNumberEnv
    env = ragen.envs.make("guess_number", max_number=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(env)
    with pytest.raises(ValueError, match="unknown config key 'bogus'"):
        ragen.envs.make("guess_number", bogus=1)


def test_contract_and_baselines(example):
    env = ragen.envs.make("guess_number")
    first, _ = env.reset(seed=4)
    assert env.reset(seed=4)[0] == first and first in env.observation_space
    _, _, _, _, info = env.step(env.parse_action(" 3 "))
    assert {"success", "action_is_valid", "action_is_effective"} <= set(info)
    expert = evaluate_agent("guess_number", {}, ExpertAgent(), range(30))
    random = evaluate_agent("guess_number", {}, RandomAgent(seed=0), range(30))
    assert expert["success"] == 1.0 and expert["steps_mean"] <= 5
    assert random["success"] < 0.8


def test_playable_in_the_terminal(example):
    env = ragen.envs.make("guess_number")
    env.reset(seed=0)
    lines = []
    while not env.done:
        guess = ExpertAgent().act(env)[0]
        lines.append(guess)
        env.step(env.parse_action(guess))
    n, out = len(lines), []
    result = play("guess_number", {}, seed=0, input_fn=lambda _: lines.pop(0), print_fn=out.append, agent={"max_turn": 6})
    assert result["success"] and result["turns"] == n
    assert n == 1 or any("my number is" in o for o in out)


def test_trains_one_step_with_the_tiny_model(example, tmp_path):
    args = [
        "train", "guess_number", "model=tiny", "trainer.total_steps=1", "trainer.val_episodes=2",
        "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'run'}",
    ]
    assert main(args) == 0
    assert any((tmp_path / "run").iterdir())


def test_example_script_runs_as_a_program():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "play", "--seed", "1"], input="8\nquit\n",
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Guess my secret integer" in proc.stdout and "Reward: " in proc.stdout
