"""How a reply's end is read: which end token the model sampled, text after a stop string inside its last token,
and how many actions an episode really ran."""

import pytest

from ragen.agent import AgentConfig, Rollout
from ragen.agent.rollout import through_stop
from ragen.eval.metrics import episode_metrics
from ragen.models.backend import Generation, SamplingParams
from tests.agent.test_context import WalkEnv


class TokenBackend:
    """Returns pre-set replies given as (token ids, finish reason); records every prompt."""

    def __init__(self, replies):
        self.replies, self.prompts = list(replies), []

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            ids, finish = self.replies.pop(0)
            out.append(Generation(list(ids), finish))
        return out


def run(tokenizer, replies, settings, stop=()):
    backend = TokenBackend(replies)
    rollout = Rollout(backend, tokenizer, settings, SamplingParams(max_new_tokens=64, stop=tuple(stop)))
    return rollout.run([WalkEnv()], [0], [0], "walk"), backend


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("end_token", ["<|endoftext|>", "<|im_end|>"])
def test_the_next_prompt_closes_the_reply_after_the_end_token_the_model_sampled(tokenizer, end_token):
    """A model may have several end tokens (Qwen2.5: ``<|im_end|>`` and ``<|endoftext|>``; the backends stop on every
    id of ``generation_config.eos_token_id``). The template's closing ``<|im_end|>\\n`` loses its first token only
    when that is the token the model ended on: ending on ``<|endoftext|>`` used to drop the turn's ``<|im_end|>``."""
    end = tokenizer.convert_tokens_to_ids(end_token)
    assert tokenizer.eos_token == "<|im_end|>" and end is not None
    reply = ids(tokenizer, "<think>t</think><answer>Right</answer>") + [end]
    (traj,), backend = run(tokenizer, [(reply, "eos"), (reply, "eos")], AgentConfig(max_turn=2))
    _, span_end = traj.turn_spans[0]
    after = tokenizer.decode(traj.input_ids[span_end - 1 : span_end + 6], skip_special_tokens=False)
    if end_token == "<|im_end|>":
        assert after.startswith("<|im_end|>\n<|im_start|>user")  # the model's own <|im_end|>, not added again
    else:
        assert after.startswith("<|endoftext|><|im_end|>\n<|im_start|>user")  # the model's token, then the closing
    assert backend.prompts[1] == traj.input_ids[: len(backend.prompts[1])]  # what the model saw is what is trained


def test_text_after_the_stop_string_inside_the_last_token_is_not_part_of_the_answer(tokenizer):
    """Generation stops at the token completing ``</answer>``; that token may carry more (``>.``). The answer is
    read up to the stop string, so a correct answer is not a format error."""
    reply = ids(tokenizer, "<think>t</think><answer>Right</answer>.")
    assert tokenizer.convert_ids_to_tokens(reply)[-1] == ">."  # the stop string ends inside this token
    (traj,), _ = run(tokenizer, [(reply, "stop")], AgentConfig(max_turn=1), stop=["</answer>"])
    assert traj.turns[0].format_valid and traj.turns[0].actions == ["Right"]
    assert traj.turns[0].response.endswith("</answer>.")  # the turn keeps what the model wrote
    # without a stop (the reply ended another way) trailing text still breaks the format
    (traj,), _ = run(tokenizer, [(reply, "length")], AgentConfig(max_turn=1), stop=["</answer>"])
    assert not traj.turns[0].format_valid


@pytest.mark.parametrize("text,stops,expected", [
    ("<answer>a</answer>.", ["</answer>"], "<answer>a</answer>"),
    ("x STOP y END z", ["END", "STOP"], "x STOP"),  # the earliest stop string
    ("no stop here", ["</answer>"], "no stop here"),
    ("abc", [], "abc"),
    ("abc", [""], "abc"),
])
def test_through_stop(text, stops, expected):
    assert through_stop(text, stops) == expected


def test_actions_per_episode_counts_the_actions_the_env_ran(tokenizer):
    """``actions_per_episode`` counts executed actions, as the baselines do: an action past ``max_actions_per_traj`` is
    written but not run (it used to be counted)."""
    right2 = ids(tokenizer, "<think>t</think><answer>Right || Right</answer>")
    settings = AgentConfig(max_turn=3, max_actions_per_turn=2, max_actions_per_traj=3)
    (traj,), _ = run(tokenizer, [(right2, "stop"), (right2, "stop")], settings)
    # turn 1 runs both; turn 2 may run one more (the budget of 3): the second action of turn 2 never runs
    assert [t.actions_executed for t in traj.turns] == [2, 1]
    assert traj.num_actions == 3 and sum(len(t.actions) for t in traj.turns) == 4
    assert episode_metrics([traj], "val")["val/actions_per_episode"] == 3.0
