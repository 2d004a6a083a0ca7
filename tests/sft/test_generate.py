"""SFT data round-trip: generated text parses back to the solver's actions and replays to success."""

import json

import pytest

import ragen.envs
from ragen.agent.parser import parse_response
from ragen.cli import main
from ragen.config import load_config
from ragen.envs.agents import ExpertAgent
from ragen.sft.generate import SEED_BOUND, agent_settings, expert_records, read_jsonl, rollout_records

CASES = {
    "sokoban": ("sokoban", []),
    "frozen_lake_slippery": ("frozen_lake", ["agent.max_turn=30"]),
    "frozen_lake_deterministic": ("frozen_lake", ["env.config.is_slippery=false", "agent.max_turn=4", "agent.max_actions_per_turn=3"]),
    "frozen_lake_slippery_two_per_turn": ("frozen_lake", ["agent.max_turn=10", "agent.max_actions_per_turn=2",
                                                          "agent.max_actions_per_traj=20"]),
    "bandit": ("bandit", []),
    "bandit_test_names": ("bandit", ["env.config.name_set=test", "agent.enable_think=true", "agent.response_prefix=''"]),
}


def replay(config, record) -> bool:
    """Parse every assistant message with the rollout's parser and step the parsed actions in a fresh env."""
    settings = agent_settings(config)
    env = ragen.envs.make(config.env.name, **config.env.config)
    env.reset(seed=record["seed"])
    success, done, left = False, False, settings.max_actions_per_traj or None
    replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert len(replies) == len(record["actions"]) == len(record["plans"])
    for reply, actions, plan in zip(replies, record["actions"], record["plans"]):
        assert not done, "a reply after the episode ended"
        parsed = parse_response(reply, enable_think=settings.enable_think, max_actions=settings.max_actions_per_turn,
                                action_sep=settings.action_sep)
        assert parsed.format_valid, (reply, parsed.error)
        # The text parses back to exactly the solver's actions: the head of its plan for this turn.
        assert parsed.actions == actions == plan[: settings.max_actions_per_turn]
        for name in parsed.actions[:left]:
            action_id = env.unwrapped.parse_action(name)
            assert action_id is not None, name
            _, _, terminated, truncated, info = env.step(action_id)
            success = bool(info["success"])
            left = None if left is None else left - 1
            if terminated or truncated:
                done = True
                break
    return success


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_data_round_trips_to_success(case):
    env, overrides = CASES[case]
    config = load_config(env, overrides)
    stats: dict = {}
    records = list(expert_records(config, 6, stats=stats))
    assert len(records) == 6 and stats["succeeded"] >= 6
    assert len({r["seed"] for r in records}) == 6 and all(0 <= r["seed"] < SEED_BOUND for r in records)
    for record in records:
        assert record["success"] and record["env"] == env
        assert replay(config, record)


def test_sokoban_rationale_states_the_bfs_plan():
    config = load_config("sokoban")
    for record in expert_records(config, 4):
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        for reply, plan in zip(replies, record["plans"]):
            think = parse_response(reply, max_actions=2).think
            assert f"The shortest plan is {', '.join(plan)} ({len(plan)} move" in think
            # Each turn re-plans from the current state: the plan shrinks by the actions taken.
        lengths = [len(p) for p in record["plans"]]
        assert all(a - b == 2 for a, b in zip(lengths, lengths[1:])), lengths


@pytest.mark.parametrize("low_payoff, verdict", [(0.1, "the risky arm is better"), (0.5, "the safe arm is better")])
def test_bandit_rationale_judges_each_arm_in_listed_order_before_choosing(low_payoff, verdict):
    from ragen.envs.bandit import NAMES

    config = load_config("bandit", ["agent.enable_think=true", "agent.response_prefix=''",
                                    f"env.config.low_payoff={low_payoff}"])
    records = list(expert_records(config, 16))
    assert len(records) == 16 and all(r["success"] for r in records)
    kind = {name: "risky" for name in NAMES["train"]["high"]} | {name: "safe" for name in NAMES["train"]["low"]}
    for record in records:
        state = record["messages"][-2]["content"]
        first, second = state.split("The arms are ")[1].split(". Which arm")[0].split(" and ")
        think = parse_response(record["messages"][-1]["content"], max_actions=1).think
        chosen = record["actions"][0][0]
        assert kind[chosen] == verdict.split()[1]  # the expert pulls the arm with the higher mean
        # The first words describe the first listed arm, whichever is chosen; the verdict comes last.
        assert think.startswith(f"Being a{'n' if first[0] in 'AEIOU' else ''} {first} is a {kind[first]} job. ")
        assert f" {second} is a {kind[second]} job. " in think
        assert think.endswith(f"{verdict}, so I pull {chosen}.")


def test_slippery_lake_data_is_the_finite_horizon_policy_for_the_moves_left():
    """``ragen sft generate`` gives the expert the episode's budget: each answer is the optimal
    action for the moves left (20 turns x 1 action here), and the rationale says so."""
    from ragen.envs.frozen_lake import LakeSolver

    config = load_config("frozen_lake", ["agent.max_turn=20", "agent.max_actions_per_turn=1", "agent.max_actions_per_traj=20",
                                         "agent.enable_think=true"])
    settings = agent_settings(config)
    checked = 0
    for record in expert_records(config, 4, keep_failures=True):
        env = ragen.envs.make(config.env.name, **config.env.config)
        env.reset(seed=record["seed"])
        solver = LakeSolver(env)
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        for steps, (reply, [action]) in enumerate(zip(replies, record["actions"])):
            assert action == env.action_lookup[solver.action(env.state, 20 - steps)]
            assert f"within the {20 - steps} move" in parse_response(reply, enable_think=True).think
            checked += 1
            _, _, terminated, truncated, _ = env.step(env.parse_action(action))
            if terminated or truncated:
                break
    assert checked >= 8 and settings.max_actions_per_turn == 1


def test_user_messages_are_the_rollout_wording():
    config = load_config("sokoban")
    [record] = expert_records(config, 1)
    env = ragen.envs.make("sokoban", **config.env.config)
    observation, _ = env.reset(seed=record["seed"])
    messages = record["messages"]
    assert messages[0] == {"role": "system", "content": config.agent.system_prompt}
    assert messages[1]["content"].startswith(env.unwrapped.instructions)
    assert messages[1]["content"].endswith(f"Turn 1:\nState:\n{observation}\nYou have 10 actions left.")
    assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * (len(messages[1:]) // 2)


def test_cli_generate_writes_messages_jsonl(tmp_path):
    out = tmp_path / "data.jsonl"
    assert main(["sft", "generate", "sokoban", "seed=3", "--n", "5", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 5
    records = [json.loads(line) for line in lines]
    keys = set(records[0])
    assert {"messages", "env", "seed", "plans", "actions", "success", "agent"} <= keys
    assert all(set(r) == keys for r in records)
    # Same seed, same data.
    again = tmp_path / "again.jsonl"
    assert main(["sft", "generate", "sokoban", "seed=3", "--n", "5", "--out", str(again)]) == 0
    assert again.read_text() == out.read_text()


def test_jsonl_loads_with_the_datasets_library(tmp_path):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "data.jsonl"
    assert main(["sft", "generate", "sokoban", "--n", "4", "--out", str(out)]) == 0
    ds = datasets.load_dataset("json", data_files=str(out), split="train")
    assert len(ds) == 4
    assert ds[0]["messages"] == read_jsonl(out)[0]["messages"]


def _fake_run(tmp_path, config_name, overrides, episodes):
    """A run dir with config.yaml and one rollouts/*.jsonl, as ragen train writes them."""
    from ragen.config import to_yaml

    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    config = load_config(config_name, overrides)
    (run / "config.yaml").write_text(to_yaml(config))
    with (run / "rollouts" / "step_000001.jsonl").open("w") as f:
        for episode in episodes:
            f.write(json.dumps(episode) + "\n")
    return run, config


def _logged(config, seed, responses):
    """A rollout log record of ``responses`` played from ``seed`` (what the trainer's save_rollouts writes)."""
    env = ragen.envs.make(config.env.name, **config.env.config)
    observation, _ = env.reset(seed=seed)
    turns, success = [], False
    for response in responses:
        parsed = parse_response(response, max_actions=config.agent.max_actions_per_turn)
        reward = 0.0
        for name in parsed.actions if parsed.format_valid else []:
            observation, r, terminated, truncated, info = env.step(env.unwrapped.parse_action(name))
            reward += r
            success = info["success"]
            if terminated or truncated:
                break
        turns.append({"response": response, "actions": parsed.actions, "format_valid": parsed.format_valid,
                      "env_reward": reward, "format_penalty": 0.0 if parsed.format_valid else -0.1, "observation": observation})
    return {"step": 1, "env": config.env.name, "group_id": 0, "seed": seed, "reward": 0.0, "success": success,
            "error": "", "initial_observation": "", "turns": turns, "tokens": [], "loss_mask": [], "advantages": []}


def test_from_run_keeps_only_successful_well_formed_episodes(tmp_path):
    config = load_config("sokoban")
    env = ragen.envs.make("sokoban", **config.env.config)
    env.reset(seed=11)
    plan = ExpertAgent().plan(env)
    good = [f"<think> t{i} </think> <answer>{' || '.join(plan[i:i + 2])}</answer>" for i in range(0, len(plan), 2)]
    wrong = ["<think>x</think><answer>Left</answer>"] * 2
    episodes = [_logged(config, 11, good), _logged(config, 11, good), _logged(config, 12, wrong), _logged(config, 11, ["garbage"] + good)]
    run, _ = _fake_run(tmp_path, "sokoban", [], episodes)
    records = list(rollout_records(run))
    assert len(records) == 1  # the duplicate, the failure and the malformed turn are left out
    [record] = records
    assert record["seed"] == 11 and record["success"] and record["source"].startswith("rollout:")
    replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert replies[0] == f"<think>t0</think><answer>{' || '.join(plan[:2])}</answer>"
    out = tmp_path / "rs.jsonl"
    assert main(["sft", "generate", "--from-run", str(run), "--out", str(out)]) == 0
    assert read_jsonl(out)[0]["messages"] == record["messages"]


def test_generate_plays_the_runs_training_tag(tmp_path):
    """A config that trains on an env tag (es.train) gets demonstrations of that tag: its env,
    env config, horizon and instructions, worded as the rollout words them."""
    tags = ("es.tags={Lake: {env: frozen_lake, config: {size: 4, is_slippery: false}, max_turn: 3, "
            "max_actions_per_turn: 2, instructions: 'Reach G. Example answer: <answer>Down</answer>'}}")
    config = load_config("bandit", [tags, "es.train=[{tag: Lake}]", "es.val=[{tag: Lake}]"])
    records = list(expert_records(config, 3))
    for record in records:
        assert record["env"] == "frozen_lake" and record["env_config"] == {"size": 4, "is_slippery": False}
        assert record["agent"]["max_turn"] == 3 and record["agent"]["max_actions_per_turn"] == 2
        first_user = next(m["content"] for m in record["messages"] if m["role"] == "user")
        assert first_user.startswith("Reach G. Example answer: <answer>Down</answer>\n")
        assert len(record["actions"]) <= 3 and all(len(a) <= 2 for a in record["actions"])
    two = load_config("bandit", [tags, "es.train=[{tag: Lake}, {tag: Bandit}]"])
    with pytest.raises(ValueError, match="one env"):
        next(expert_records(two, 1))


def test_generate_refuses_window_mode():
    with pytest.raises(ValueError, match="context_mode=window"):
        next(expert_records(load_config("sokoban", ["agent.context_mode=window"]), 1))


def test_generate_notes_replies_longer_than_the_rollouts_token_budget(tmp_path, capsys):
    from ragen.agent.context import ChatTokens
    from ragen.models.loading import load_tokenizer

    out = tmp_path / "bandit.jsonl"
    # The bandit preset's 16 new tokens hold a no-think answer but not the expert's <think> rationale.
    think = ["agent.enable_think=true", "agent.response_prefix=<think>"]
    assert main(["sft", "generate", "bandit", *think, "--n", "4", "--out", str(out)]) == 0
    chat = ChatTokens(load_tokenizer("smollm2-135m"))
    lengths = [len(chat.encode_reply(m["content"].removeprefix(r["agent"]["response_prefix"])))
               for r in read_jsonl(out) for m in r["messages"] if m["role"] == "assistant"]
    assert len(lengths) == 4 and min(lengths) > 16
    err = capsys.readouterr().err.splitlines()
    assert err == [f"ragen: note: 4 of 4 replies are longer than rollout.max_new_tokens=16 tokens (longest "
                   f"{max(lengths)}): an RL run with this config would cut them off; raise rollout.max_new_tokens "
                   "there (and here, to silence this)"]
    # A budget the longest reply fits exactly: nothing to note.
    budget = f"rollout.max_new_tokens={max(lengths)}"
    assert main(["sft", "generate", "bandit", *think, budget, "--n", "4", "--out", str(out)]) == 0
    assert capsys.readouterr().err == ""
    # The preset's own no-think replies fit its budget.
    assert main(["sft", "generate", "bandit", "--n", "4", "--out", str(out)]) == 0
    assert capsys.readouterr().err == ""
