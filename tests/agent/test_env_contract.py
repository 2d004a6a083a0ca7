"""An env that breaks gymnasium's API ends its own episode with a clear error; the rollout, the metrics and the
batch builder go on (ragen/envs/contract.py)."""

import math

import numpy as np
import pytest

from ragen.agent import AgentConfig, Rollout
from ragen.envs import make
from ragen.envs.registry import _REGISTRY  # tests add envs with monkeypatch.setitem: removed afterwards
from ragen.agent.conversation import record_conversation
from ragen.envs.agents import RandomAgent, run_episode
from ragen.envs.contract import EnvContractError, checked_reward, checked_step, interface_problem
from ragen.eval.metrics import episode_metrics
from ragen.models.backend import SamplingParams
from ragen.train.batch import collate
from tests.agent.test_mixed_rollout import ReplyBackend, WalkEnv

ANSWER = "<think>t</think><answer>Right</answer>"


class BrokenWalk(WalkEnv):
    """WalkEnv whose ``mode`` breaks one part of the contract from the first ``step`` on (or at ``reset``)."""

    def __init__(self, mode: str):
        self.mode = mode

    def reset(self, *, seed=None, options=None):
        observation, info = super().reset(seed=seed, options=options)
        if self.mode == "reset_dict_obs":
            return {"pos": 0}, info
        if self.mode == "reset_not_tuple":
            return observation
        return observation, info

    def parse_action(self, text):
        if self.mode == "parse_raises":
            raise KeyError(text)
        if self.mode == "parse_str":
            return "2"
        if self.mode == "parse_np_int":
            return np.int64(super().parse_action(text))
        return super().parse_action(text)

    def step(self, action):
        observation, reward, terminated, truncated, info = super().step(action)
        broken = {
            "reward_str": lambda: (observation, "one", terminated, truncated, info),
            "reward_array": lambda: (observation, np.array([1.0, 2.0]), terminated, truncated, info),
            "reward_nan": lambda: (observation, math.nan, terminated, truncated, info),
            "info_none": lambda: (observation, reward, terminated, truncated, None),
            "obs_dict": lambda: ({"pos": self.pos}, reward, terminated, truncated, info),
            "obs_array": lambda: (np.zeros((2, 2)), reward, terminated, truncated, info),
            "four_tuple": lambda: (observation, reward, terminated, info),
            "flag_array": lambda: (observation, reward, np.array([True, False]), truncated, info),
        }
        return broken[self.mode]() if self.mode in broken else (observation, reward, terminated, truncated, info)


BREAKING = {  # mode -> words the episode's error must contain
    "reset_dict_obs": "BrokenWalk.reset returned a dict observation",
    "reset_not_tuple": "BrokenWalk.reset returned a str",
    "parse_raises": "parse_action raised KeyError",
    "parse_str": "parse_action('Right') returned a str",
    "reward_str": "returned a str reward ('one')",
    "reward_array": "returned an ndarray reward",
    "reward_nan": "non-finite reward (nan)",
    "info_none": "returned info of type NoneType",
    "obs_dict": "BrokenWalk.step returned a dict observation",
    "obs_array": "an ndarray of shape (2, 2) observation",
    "four_tuple": "BrokenWalk.step returned a 4-tuple",
    "flag_array": "`terminated` = array([ True, False])",
}


def _rollout(tokenizer, envs, max_turn=2):
    backend = ReplyBackend(tokenizer, lambda text, i: ANSWER)
    n = len(envs)
    return Rollout(backend, tokenizer, AgentConfig(max_turn=max_turn), SamplingParams()).run(
        envs, [0] * n, list(range(n)), ["walk"] * n)


@pytest.mark.parametrize("mode", sorted(BREAKING))
def test_a_broken_env_ends_its_own_episode_with_a_clear_error(tokenizer, mode):
    trajs = _rollout(tokenizer, [BrokenWalk(mode), WalkEnv()])
    broken, healthy = trajs
    assert broken.done and BREAKING[mode] in broken.error
    assert "Traceback" not in broken.error or mode == "parse_raises"  # a contract error is one sentence
    # the healthy env of the same batch played its two turns; the metrics and the batch builder take both
    assert not healthy.error and len(healthy.turns) == 2 and healthy.turns[-1].observation == "pos=2"
    metrics = episode_metrics(trajs, prefix="rollout")
    assert metrics["rollout/env_errors"] == 1.0 and math.isfinite(metrics["rollout/reward_mean"])
    collate([t for t in trajs if not t.error], pad_id=0)  # the trainer updates on the episodes without an error


def test_numpy_values_are_accepted_as_their_python_values(tokenizer):
    class NumpyWalk(WalkEnv):
        def step(self, action):
            observation, reward, terminated, truncated, info = super().step(action)
            info = {**info, "metric/distance": np.float32(3 - self.pos), "success": np.bool_(info["success"])}
            return observation, np.float32(reward), np.bool_(terminated), truncated, info

    (traj,) = _rollout(tokenizer, [NumpyWalk()], max_turn=3)
    assert not traj.error and traj.success and traj.turns[-1].env_reward == 1.0
    assert [turn.info["metric/distance"] for turn in traj.turns] == [2.0, 1.0, 0.0]
    assert type(traj.turns[0].info["metric/distance"]) is float
    (parsed,) = _rollout(tokenizer, [BrokenWalk("parse_np_int")])
    assert not parsed.error and len(parsed.turns) == 2


def test_the_contract_checks_directly():
    import torch

    env = WalkEnv()
    env.reset(seed=0)
    assert checked_step(env, env.step(2)) == ("pos=1", 0.0, False, False,
                                              {"success": False, "action_is_valid": True, "action_is_effective": True})
    # what float(reward) took before the contract: bools, NumPy scalars, one-element arrays and tensors
    for good, value in ((True, 1.0), (np.bool_(False), 0.0), (np.int64(3), 3.0), (np.array(2.5), 2.5),
                        (np.array([0.5]), 0.5), (torch.tensor(1.5), 1.5), (torch.tensor([2.0]), 2.0)):
        assert checked_reward(env, good) == value
    for bad in ("1", b"1", None, 1j, np.array([1.0, 2.0]), torch.tensor([1.0, 2.0]), math.inf, -math.inf, np.float32("nan")):
        with pytest.raises(EnvContractError):
            checked_reward(env, bad)


class NoInstructions(WalkEnv):
    instructions = None


class NoParser(WalkEnv):
    parse_action = None


def test_make_refuses_an_env_without_parse_action_and_the_rollout_needs_text_instructions(tokenizer, monkeypatch):
    assert interface_problem(WalkEnv()) is None and interface_problem(NoInstructions()) is None
    monkeypatch.setitem(_REGISTRY, "test_contract_no_parser", NoParser)
    with pytest.raises(TypeError, match="env 'test_contract_no_parser': NoParser has no `parse_action"):
        make("test_contract_no_parser")
    # instructions may come from the run (a tag's)  instead of the env
    monkeypatch.setitem(_REGISTRY, "test_contract_no_instructions", NoInstructions)
    env = make("test_contract_no_instructions")
    (missing,) = _rollout(tokenizer, [env])
    assert "NoInstructions has no text `instructions` (got NoneType)" in missing.error
    backend = ReplyBackend(tokenizer, lambda text, i: ANSWER)
    (given,) = Rollout(backend, tokenizer, AgentConfig(max_turn=2, instructions="Walk right."), SamplingParams()).run(
        [NoInstructions()], [0], [0], ["walk"])
    assert not given.error and "Walk right." in backend.prompts[0]


def test_agents_eval_baselines_and_sft_generation_check_the_env_too(monkeypatch):
    from ragen.config import load_config
    from ragen.eval.evaluate import run_baseline
    from ragen.sft.generate import expert_records

    with pytest.raises(EnvContractError, match="returned a str reward"):
        run_episode(BrokenWalk("reward_str"), RandomAgent(seed=0), seed=0, max_turns=2)
    with pytest.raises(EnvContractError, match="returned info of type NoneType"):
        record_conversation(BrokenWalk("info_none"), RandomAgent(seed=0), seed=0)

    class ExpertWalk(BrokenWalk):
        def expert_actions(self):
            return ["Right"]

    monkeypatch.setitem(_REGISTRY, "test_contract_info_none", lambda **cfg: ExpertWalk("info_none"))
    config = load_config("test_contract_info_none", ["model=tiny", "agent.enable_think=false"])
    row = run_baseline(config, "expert", [0, 1])
    assert row == {"skipped": "ExpertWalk.step returned info of type NoneType; gymnasium's API returns a dict"}
    with pytest.raises(EnvContractError, match=r"^seed \d+: ExpertWalk.step returned info of type NoneType"):
        list(expert_records(config, 2))


def test_a_constructor_that_raises_is_one_line_naming_the_tag(monkeypatch):
    from ragen.envs.tags import EnvTag, TagError

    def factory(**cfg):
        raise RuntimeError("no license server")

    monkeypatch.setitem(_REGISTRY, "test_contract_ctor_raises", factory)
    with pytest.raises(TagError, match=r"env tag 'Mine': building the env raised RuntimeError\('no license server'\)"):
        EnvTag(name="Mine", env="test_contract_ctor_raises").make_env()


class LongWalk(WalkEnv):
    """WalkEnv whose observation after ``long_after`` steps is ``words`` words long."""

    def __init__(self, words: int, long_after: int = 0):
        self.words, self.long_after = words, long_after

    def reset(self, *, seed=None, options=None):
        observation, info = super().reset(seed=seed, options=options)
        return (observation + " far" * self.words if self.long_after == 0 else observation), info

    def step(self, action):
        observation, *rest = super().step(action)
        return (observation + " far" * self.words if self.pos >= self.long_after else observation), *rest


def test_a_prompt_beyond_the_models_context_ends_its_episode_with_an_error(tokenizer):
    backend = ReplyBackend(tokenizer, lambda text, i: ANSWER)
    backend.context_limit = 400
    sampling = SamplingParams(max_new_tokens=16)
    envs = [LongWalk(words=1000), LongWalk(words=300, long_after=1), WalkEnv()]
    trajs = Rollout(backend, tokenizer, AgentConfig(max_turn=3), sampling).run(envs, [0] * 3, [0, 1, 2], ["walk"] * 3)
    first, later, short = trajs
    assert first.error.startswith("turn 1: the prompt of ") and not first.turns  # never sent to the model
    assert "plus rollout.max_new_tokens=16 exceeds the model's context of 400 tokens" in first.error
    # a later turn that does not fit ends the episode there, as max_turn would: no error, its turn kept for training
    assert not later.error and later.done and len(later.turns) == 1
    assert later.context_full.startswith("turn 2: the prompt of ") and "ended after turn 1" in later.context_full
    assert len(later.input_ids) == later.turn_spans[-1][1] == len(later.loss_mask)  # no unanswered prompt left
    assert not short.error and not short.context_full and len(short.turns) == 3
    metrics = episode_metrics(trajs, prefix="rollout")
    assert metrics["rollout/env_errors"] == 1.0 and metrics["rollout/context_full"] == 0.5
    assert all(len(tokenizer.encode(p)) <= 400 - 16 for p in backend.prompts)
    assert backend.batch_sizes == [2, 1, 1]  # the over-long prompts never reached the backend


def test_the_hf_backend_reports_the_models_context(tiny):
    from ragen.agent.rollout import context_limit
    from ragen.models.backend import HFBackend

    model, tokenizer = tiny
    assert context_limit(HFBackend(model, tokenizer)) == model.config.max_position_embeddings > 0


def test_context_full_in_window_mode_keeps_one_window_prompt_per_turn(tokenizer):
    backend = ReplyBackend(tokenizer, lambda text, i: ANSWER)
    backend.context_limit = 400
    settings = AgentConfig(max_turn=3, context_mode="window", max_context_window=1)
    (traj,) = Rollout(backend, tokenizer, settings, SamplingParams(max_new_tokens=16)).run(
        [LongWalk(words=300, long_after=1)], [0], [0], ["walk"])
    assert traj.context_full and not traj.error and len(traj.turns) == 1 and len(traj.window_prompts) == 1


def test_a_chat_api_backend_is_sent_escaped_messages(tokenizer):
    from ragen.agent.context import WORD_JOINER

    class MessagesBackend(ReplyBackend):
        wants_messages = True

        def generate(self, prompts, params, messages=None):
            self.sent = messages
            return super().generate(prompts, params)

    class Injecting(WalkEnv):
        def reset(self, *, seed=None, options=None):
            observation, info = super().reset(seed=seed, options=options)
            return observation + "<|im_end|>", info

    backend = MessagesBackend(tokenizer, lambda text, i: ANSWER)
    Rollout(backend, tokenizer, AgentConfig(max_turn=1), SamplingParams()).run([Injecting()], [0], [0], ["walk"])
    (user,) = [m["content"] for m in backend.sent[0] if m["role"] == "user"]
    assert user.endswith(f"<{WORD_JOINER}|im_end|>") and "<|im_end|>" not in user


def test_play_takes_instructions_as_the_rollout_does(monkeypatch):
    from ragen.agent.play import play

    monkeypatch.setitem(_REGISTRY, "test_contract_play_no_instructions", NoInstructions)
    with pytest.raises(ValueError, match="NoInstructions has no text `instructions`"):
        play("test_contract_play_no_instructions", input_fn=lambda prompt: "quit", print_fn=lambda *a: None)
    shown = []
    play("test_contract_play_no_instructions", seed=0, input_fn=lambda prompt: "quit", print_fn=shown.append,
         agent={"instructions": "Walk right."})
    assert any("Walk right." in str(line) for line in shown)


def test_a_malformed_sokoban_turn_costs_more_than_a_useless_well_formed_one():
    """The trap RL fell into: a malformed turn (−0.1) cost less than two moves that push nothing (−0.2), so answering
    malformed paid. Now it costs the format penalty plus the step penalty of every action the turn could take."""
    import ragen.envs
    from ragen.agent.rollout import AgentConfig, malformed_turn_penalty

    env = ragen.envs.make("sokoban")
    settings = AgentConfig(max_actions_per_turn=2, format_penalty=-0.1)
    assert malformed_turn_penalty(settings, env, None) == pytest.approx(-0.3)
    assert malformed_turn_penalty(settings, env, 1) == pytest.approx(-0.2)  # one action left in the episode's budget
    useless_turn = 2 * env.idle_action_reward  # two moves into a wall: the step penalty twice, nothing else
    assert malformed_turn_penalty(settings, env, None) < useless_turn
    # envs where moving is free keep the plain format penalty
    assert malformed_turn_penalty(settings, ragen.envs.make("frozen_lake"), None) == pytest.approx(-0.1)
    assert malformed_turn_penalty(settings, ragen.envs.make("bandit"), None) == pytest.approx(-0.1)
