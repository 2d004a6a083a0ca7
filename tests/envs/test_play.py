"""``ragen play``: scripted input plays envs through exactly the model's prompt text."""

import subprocess
import sys

import pytest

import ragen.envs
from ragen.agent.context import PromptFormat
from ragen.cli import main
from ragen.envs.agents import ExpertAgent
from ragen.agent.play import RULE, main_play, parse_overrides, play, split_answer


def scripted(lines):
    """An ``input_fn`` replaying ``lines``, then EOF."""
    queue = list(lines)

    def input_fn(prompt=""):
        if not queue:
            raise EOFError
        return queue.pop(0)

    return input_fn


def capture():
    out = []
    return out, lambda *args, **_: out.append(" ".join(str(a) for a in args))


def test_bandit_shows_the_models_first_message_and_the_reward():
    env = ragen.envs.make("bandit")
    obs, _ = env.reset(seed=0)
    high = env.action_lookup[env.high_action]
    out, print_fn = capture()
    result = play("bandit", {}, seed=0, input_fn=scripted([f"<answer>{high}</answer>"]), print_fn=print_fn)
    assert result["success"] and not result["quit"] and result["turns"] == 1
    first = PromptFormat().first_user_message(env.instructions, obs, 1, None)
    assert first in out and RULE in out
    assert out[-1].startswith("Episode over after 1 turn(s): success=True")
    assert "Reward:" in out[-2]


def test_sokoban_solved_with_the_experts_actions_bare_and_tagged():
    env = ragen.envs.make("sokoban")
    seed = next(s for s in range(100) if len(ExpertAgent().act(env) if env.reset(seed=s) else []) >= 5)
    env.reset(seed=seed)
    plan = ExpertAgent().act(env)
    # first two moves as a full <think>/<answer> reply, the rest as bare names, two per turn
    lines = [f"<think>go</think><answer>{plan[0]} || {plan[1]}</answer>"]
    lines += [" || ".join(plan[i : i + 2]) for i in range(2, len(plan), 2)]
    out, print_fn = capture()
    result = play(
        "sokoban", {}, seed=seed, input_fn=scripted(lines), print_fn=print_fn,
        agent={"max_turn": 100, "max_actions_per_turn": 2},
    )
    assert result["success"] and result["turns"] == len(lines)
    assert result["reward"] == pytest.approx(10 + 1 - 0.1 * len(plan))
    # each next message is exactly PromptFormat's, with the step reward of the turn
    fmt = PromptFormat(max_actions_per_turn=2)
    env.reset(seed=seed)
    reward = sum(env.step(env.parse_action(a))[1] for a in plan[:2])
    assert fmt.next_user_message(reward, env.render(), 2, None) in out


def test_invalid_answer_costs_the_format_penalty_and_keeps_the_state():
    out, print_fn = capture()
    result = play("sokoban", {}, seed=1, input_fn=scripted(["Jump", "quit"]), print_fn=print_fn)
    assert result["quit"] and result["reward"] == pytest.approx(-0.1)
    assert any("Your answer was invalid (unknown action 'Jump'); the state did not change.\nReward: -0.1" in o for o in out)


def test_eof_and_quit_exit_cleanly_and_overrides_parse_as_yaml():
    out, print_fn = capture()
    assert play("frozen_lake", {"size": 3, "is_slippery": False}, seed=0, input_fn=scripted([]), print_fn=print_fn)["quit"]
    env_cfg, agent = parse_overrides(["dim_room=[7, 7]", "is_slippery=false", "high_prob=0.5", "agent.max_turn=3", "name_set=test"])
    assert env_cfg == {"dim_room": [7, 7], "is_slippery": False, "high_prob": 0.5, "name_set": "test"}
    assert agent == {"max_turn": 3}
    with pytest.raises(ValueError, match="not key=value"):
        parse_overrides(["oops"])
    with pytest.raises(ValueError, match="unknown agent setting"):
        parse_overrides(["agent.bogus=1"])
    # a value of the wrong type names its key (was "'<' not supported between 'str' and 'int'")
    with pytest.raises(ValueError, match="agent.max_turn: Value 'abc' of type 'str' could not be converted to Integer"):
        play("bandit", seed=0, input_fn=scripted([]), print_fn=print_fn, agent={"max_turn": "abc"})
    assert split_answer("<think>x</think><answer> Up || Left </answer>", "||") == ["Up", "Left"]
    assert split_answer("Up</answer>", "||") == ["Up"]


def test_preset_agent_settings_apply_turn_limit():
    # the sokoban preset allows 10 actions per episode: the prompt says so and the game stops there
    out, print_fn = capture()
    result = main_play("sokoban", [], seed=2, input_fn=scripted(["Up || Up"] * 20), print_fn=print_fn)
    assert result["turns"] <= 5 and not result["quit"]
    assert "You have 10 actions left." in out[2]


def test_cli_errors_are_one_line_exit_2(capsys):
    assert main(["play", "nosuchenv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ragen: error: unknown env 'nosuchenv'") and err.count("\n") == 1
    assert main(["play", "sokoban", "num_boxes=0"]) == 2
    assert "num_boxes" in capsys.readouterr().err
    assert main(["play", "bandit", "arms=3"]) == 2
    assert "unknown config key 'arms'" in capsys.readouterr().err


def test_cli_play_from_stdin_exits_0():
    proc = subprocess.run(
        [sys.executable, "-m", "ragen", "play", "bandit", "--seed", "3", "name_set=test"],
        input="quit\n", capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Bandit game" in proc.stdout and "Turn 1:" in proc.stdout


@pytest.mark.parametrize(
    "args, key",
    [(["bandit", "name_set=[train]"], "name_set"), (["math_qa", "path=5"], "path"), (["textarena", "game=5"], "game")],
)
def test_cli_string_knob_of_another_type_is_one_line_exit_2(capsys, args, key):
    """YAML reads ``[train]`` as a list and ``5`` as an int: they failed deep in the env (``unhashable type: 'list'``,
    a traceback with exit 1) instead of naming the key."""
    assert main(["play", *args]) == 2
    err = capsys.readouterr().err
    assert f"config key {key!r} must be a string" in err and err.count("\n") == 1
