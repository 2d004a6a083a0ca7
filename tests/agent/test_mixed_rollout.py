"""Mixed-tag rollouts (each episode its own horizon and prompt) and the shaped reasoning rewards."""

import copy

import pytest
from gymnasium import spaces

from ragen.agent import AgentConfig, Rollout
from ragen.agent.rewards import extract_prediction, normalise_state, prediction_matches, think_is_well_formed
from ragen.envs import make
from ragen.envs.base import TextEnv
from ragen.models.backend import Generation, SamplingParams


class WalkEnv(TextEnv):
    """A 1-D walk: Right moves +1, Left -1 (ineffective at 0); reaching 3 succeeds."""

    instructions = "Walk to 3."
    action_lookup = {1: "Left", 2: "Right"}
    action_space = spaces.Discrete(2, start=1)
    observation_space = spaces.Text(max_length=64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = 0
        return f"pos={self.pos}", {}

    def step(self, action):
        action = self.check_action(action)
        moved = not (action == 1 and self.pos == 0)
        self.pos += (1 if action == 2 else -1) if moved else 0
        done = self.pos == 3
        info = {"success": done, "action_is_valid": True, "action_is_effective": moved}
        return f"pos={self.pos}", float(done), done, False, info


class ReplyBackend:
    """Answers every prompt with a reply chosen by ``pick(prompt_text, call_index)``; records batch sizes."""

    def __init__(self, tokenizer, pick):
        self.tokenizer, self.pick = tokenizer, pick
        self.batch_sizes: list[int] = []
        self.prompts: list[str] = []

    def generate(self, prompts, params):
        self.batch_sizes.append(len(prompts))
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            self.prompts.append(text)
            reply = self.pick(text, len(self.batch_sizes) - 1)
            out.append(Generation(self.tokenizer(reply, add_special_tokens=False)["input_ids"], "stop"))
        return out


def test_episodes_of_one_batch_keep_their_own_horizon_and_prompt(tokenizer):
    short = AgentConfig(max_turn=1, instructions="SHORT TAG RULES")
    long = AgentConfig(max_turn=3, max_actions_per_turn=2)
    backend = ReplyBackend(tokenizer, lambda text, i: "<think>t</think><answer>Left</answer>")
    envs = [WalkEnv() for _ in range(5)]
    trajs = Rollout(backend, tokenizer, AgentConfig(), SamplingParams()).run(
        envs, [0] * 5, [0, 0, 1, 1, 2], ["walk"] * 5,
        settings=[short, short, long, long, long], tags=["Short", "Short", "Long", "Long", "Long"],
    )
    assert [len(t.turns) for t in trajs] == [1, 1, 3, 3, 3]
    assert backend.batch_sizes == [5, 3, 3]  # the 1-turn episodes leave the batch after turn 1
    assert [t.tag for t in trajs] == ["Short", "Short", "Long", "Long", "Long"]
    # The tag's instructions replace the env's; its format line follows its own max_actions_per_turn.
    first_prompts = backend.prompts[:5]
    assert all("SHORT TAG RULES" in p and "Walk to 3." not in p for p in first_prompts[:2])
    assert all("Walk to 3." in p and "up to 2 actions" in p for p in first_prompts[2:])
    # Left at 0 is valid but changes nothing.
    assert all(turn.actions_executed == 1 and turn.actions_effective == 0 for t in trajs for turn in t.turns)


def test_run_rejects_misaligned_lists(tokenizer):
    rollout = Rollout(ReplyBackend(tokenizer, lambda *_: ""), tokenizer, AgentConfig(), SamplingParams())
    with pytest.raises(ValueError, match="one entry per env"):
        rollout.run([WalkEnv(), WalkEnv()], [0, 0], [0, 1], "walk", settings=[AgentConfig()])


# -- shaped reasoning rewards ----------------------------------------------------------------


@pytest.mark.parametrize(
    "think, expected",
    [
        ("plan <prediction>pos=1</prediction>", "pos=1"),
        ("<prediction>\n##\n#P\n</prediction>", "\n##\n#P\n"),
        ("no prediction here", None),
        ("<prediction>a</prediction><prediction>b</prediction>", None),  # two predictions: none counts
        ("<prediction>unclosed", None),
        (None, None),
    ],
)
def test_extract_prediction(think, expected):
    assert extract_prediction(think) == expected


@pytest.mark.parametrize(
    "prediction, observation, ok",
    [
        ("pos=1", "pos=1", True),
        ("\n#P_#  \n#__#\n", "#P_#\n#__#", True),  # surrounding blank lines and trailing spaces only
        ("#P_#\n#__#", "#P_#\n#_ _#", False),
        ("pos = 1", "pos=1", False),  # inner spacing counts
        ("POS=1", "pos=1", False),  # case counts
        (" #P_#", "#P_#", True),  # whole-text strip
        ("#P_#\n #__#", "#P_#\n#__#", False),  # a line's leading space counts
        (None, "pos=1", False),
    ],
)
def test_prediction_matches_exactly(prediction, observation, ok):
    assert prediction_matches(prediction, observation) is ok


def test_normalise_state_and_think_check():
    assert normalise_state("  a  \n b \n\n") == "a\n b"
    assert think_is_well_formed(True, " x ") and not think_is_well_formed(True, "  ") and not think_is_well_formed(False, "x")


def test_rollout_pays_think_and_prediction_rewards_apart_from_the_task(tokenizer):
    replies = [
        "<think>go <prediction>pos=1</prediction></think><answer>Right</answer>",  # right prediction
        "<think>go <prediction>pos=3</prediction></think><answer>Right</answer>",  # wrong (pos=2)
        "<think></think><answer>Right</answer>",  # empty think, no prediction: success, no bonus
    ]
    backend = ReplyBackend(tokenizer, lambda text, i: replies[i])
    settings = AgentConfig(max_turn=3, think_reward=0.25, prediction_reward=0.5)
    [traj] = Rollout(backend, tokenizer, settings, SamplingParams()).run([WalkEnv()], [0], [0], "walk")
    assert [t.think_reward for t in traj.turns] == [0.25, 0.25, 0.0]
    assert [t.prediction_reward for t in traj.turns] == [0.5, 0.0, 0.0]
    assert [t.prediction_correct for t in traj.turns] == [True, False, False]
    assert traj.success and traj.task_reward == 1.0  # the env's reward alone
    assert traj.reward == pytest.approx(1.0 + 0.5 + 0.5)
    assert "<prediction>" in backend.prompts[0]  # the prompt asks for one
    assert "Reward: 0\n" in backend.prompts[1]  # the model is shown the task reward, not the bonus


def test_invalid_answer_earns_no_shaped_reward(tokenizer):
    # The prediction "pos=0" is the true (unchanged) state, but the answer names no valid action.
    backend = ReplyBackend(tokenizer, lambda text, i: "<think>x <prediction>pos=0</prediction></think><answer>Jump</answer>")
    settings = AgentConfig(max_turn=1, think_reward=0.25, prediction_reward=0.5)
    [traj] = Rollout(backend, tokenizer, settings, SamplingParams()).run([WalkEnv()], [0], [0], "walk")
    turn = traj.turns[0]
    assert (turn.think_reward, turn.prediction_reward, turn.format_penalty) == (0.0, 0.0, -0.1)
    assert traj.reward == traj.task_reward == -0.1


def test_sokoban_prediction_is_checked_against_the_true_next_grid(tokenizer):
    env = make("sokoban")
    truth_env = copy.deepcopy(env)
    truth_env.reset(seed=3)
    true_next = truth_env.step(truth_env.parse_action("Up"))[0]
    wrong = true_next.replace("P", "_", 1) if "P" in true_next else true_next.replace("S", "O", 1)
    for predicted, expected in [(true_next, 0.5), (wrong, 0.0)]:
        reply = f"<think>push <prediction>\n{predicted}\n</prediction></think><answer>Up</answer>"
        backend = ReplyBackend(tokenizer, lambda text, i, r=reply: r)
        settings = AgentConfig(max_turn=1, prediction_reward=0.5)
        [traj] = Rollout(backend, tokenizer, settings, SamplingParams()).run([copy.deepcopy(env)], [3], [0], "sokoban")
        assert traj.turns[0].observation == true_next
        assert traj.turns[0].prediction_reward == expected


def test_env_metrics_reach_the_turns_and_the_episode_metrics(tokenizer):
    """Bandit's ``info["metric/second_listed"]`` survives the rollout into ``Turn.info`` and the logged metrics; a
    turn whose answer does not parse never steps the env and so reports nothing."""
    from ragen.eval.metrics import episode_metrics

    arms = []  # (first-listed, second-listed) per seed, as the rollout's envs will show them
    for seed in range(4):
        env = make("bandit")
        env.reset(seed=seed)
        arms.append((env.action_lookup[1], env.action_lookup[2]))
    answers = [arms[0][1], arms[1][1], arms[2][0], None]  # second, second, first, unparsable
    replies = {first + " and " + second: f"<think>t</think><answer>{a}</answer>" if a else "no answer"
               for (first, second), a in zip(arms, answers)}
    backend = ReplyBackend(tokenizer, lambda text, i: next(r for key, r in replies.items() if key in text))
    trajs = Rollout(backend, tokenizer, AgentConfig(max_turn=1), SamplingParams()).run(
        [make("bandit") for _ in range(4)], [0, 1, 2, 3], [0, 1, 2, 3], "bandit")
    assert [t.turns[0].info.get("metric/second_listed") for t in trajs] == [1.0, 1.0, 0.0, None]
    assert episode_metrics(trajs, "val")["val/info_second_listed"] == pytest.approx(2 / 3)


def test_group_members_number_each_group_in_call_order():
    from ragen.agent.rollout import group_members

    assert group_members([7, 7, 9, 7, 9, 3]) == [0, 1, 0, 2, 1, 0]
    assert group_members([]) == []


def test_rollout_resets_each_env_with_its_place_in_the_group(tokenizer):
    """Every env is reset with ``options={"group_member": j}``; the trajectory records ``j``, so an env that varies
    its draws within a group (Bandit's ``own_payoff_draw``) can be replayed."""
    seen = []

    class RecordingWalk(WalkEnv):
        def reset(self, *, seed=None, options=None):
            seen.append((seed, options))
            return super().reset(seed=seed, options=options)

    backend = ReplyBackend(tokenizer, lambda text, i: "<answer>Right</answer>")
    trajs = Rollout(backend, tokenizer, AgentConfig(max_turn=1), SamplingParams()).run(
        [RecordingWalk() for _ in range(5)], [4, 4, 4, 9, 9], [0, 0, 0, 1, 1], "walk")
    assert seen == [(4, {"group_member": 0}), (4, {"group_member": 1}), (4, {"group_member": 2}),
                    (9, {"group_member": 0}), (9, {"group_member": 1})]
    assert [t.group_member for t in trajs] == [0, 1, 2, 0, 1]
    assert [t.to_json()["group_member"] for t in trajs] == [0, 1, 2, 0, 1]

    # Bandit with own_payoff_draw: one group's envs see the same arms, and the high arm pays each its own draw.
    envs = [make("bandit", own_payoff_draw=True) for _ in range(8)]
    high = {}
    for env in envs:
        env.reset(seed=11)
        high[env.unwrapped.action_lookup[env.unwrapped.high_action]] = None
    [name] = high
    backend = ReplyBackend(tokenizer, lambda text, i: f"<answer>{name}</answer>")
    trajs = Rollout(backend, tokenizer, AgentConfig(max_turn=1, enable_think=False), SamplingParams()).run(
        envs, [11] * 8, [0] * 8, "bandit")
    assert len({t.initial_observation for t in trajs}) == 1 and all(t.success for t in trajs)
    assert {t.turns[0].env_reward for t in trajs} == {0.0, 1.0}  # seed 11's 8 members: not all the same draw
