"""An SFT example is token for token the trajectory the rollout records when the model writes the expert's replies."""

import copy

import pytest

import ragen.envs
from ragen.agent import Rollout
from ragen.agent.context import ChatTokens
from ragen.config import load_config
from ragen.models.backend import Generation, SamplingParams
from ragen.sft.generate import agent_settings, expert_records
from ragen.sft.masking import tokenize_conversation

# A Mistral-style template: no system role, the EOS is the whole closing of an assistant turn.
INST_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
# A template whose assistant turn is closed by text that is not the EOS.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}ASSISTANT: {{ m['content'] }}\nEND\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)


class ReplyBackend:
    """Plays given replies as if sampled: the reply's ids after the response prefix, plus the EOS if ``eos``."""

    def __init__(self, tokenizer, replies, prefix: str, eos: bool):
        self.tokenizer, self.replies, self.prefix, self.eos = tokenizer, list(replies), prefix, eos

    def generate(self, prompts, params):
        out = []
        for _ in prompts:
            reply = self.replies.pop(0)
            ids = self.tokenizer(reply[len(self.prefix):], add_special_tokens=False)["input_ids"]
            if self.eos:
                ids = ids + [self.tokenizer.eos_token_id]
            out.append(Generation(ids, "eos" if self.eos else "stop"))
        return out


@pytest.fixture(params=["chatml", "inst", "plain"])
def template_tokenizer(request, tokenizer):
    tok = copy.deepcopy(tokenizer)
    if request.param == "inst":
        tok.chat_template = INST_TEMPLATE
    elif request.param == "plain":
        tok.chat_template = PLAIN_TEMPLATE
    return request.param, tok


@pytest.mark.parametrize("preset,overrides", [("sokoban", []), ("bandit", [])])
@pytest.mark.parametrize("train_on_eos", [True, False])
def test_sft_tokens_equal_the_rollout_trajectory(template_tokenizer, preset, overrides, train_on_eos):
    name, tok = template_tokenizer
    if name == "inst":
        overrides = overrides + ["agent.system_prompt=''"]  # that template has no system role
    config = load_config(preset, overrides)
    settings = agent_settings(config)
    record = next(r for r in expert_records(config, 8) if len(r["actions"]) >= min(2, config.agent.max_turn))
    replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]

    example = tokenize_conversation(ChatTokens(tok), record["messages"], response_prefix=settings.response_prefix,
                                    train_on_eos=train_on_eos)

    # The EOS is the model's token only where the template closes a turn with it (ChatML, [INST]).
    eos = train_on_eos and name != "plain"
    backend = ReplyBackend(tok, replies, settings.response_prefix, eos=eos)
    env = ragen.envs.make(config.env.name, **config.env.config)
    [traj] = Rollout(backend, tok, settings, SamplingParams()).run([env], [record["seed"]], [0], config.env.name)

    assert traj.success and len(traj.turns) == len(replies)
    assert example.input_ids == traj.input_ids
    assert example.loss_mask == traj.loss_mask
    # The masked tokens decode to the replies (after the prefix the rollout writes itself).
    written = tok.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m], skip_special_tokens=True)
    assert written == "".join(r[len(settings.response_prefix):] for r in replies)


def test_eos_is_trained_on_only_when_asked(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<answer>A</answer>"}]
    chat = ChatTokens(tokenizer)
    with_eos = tokenize_conversation(chat, messages, train_on_eos=True)
    without = tokenize_conversation(chat, messages, train_on_eos=False)
    assert with_eos.input_ids[-1] == tokenizer.eos_token_id and with_eos.loss_mask[-1] == 1
    assert with_eos.num_trained == without.num_trained + 1


@pytest.mark.parametrize("messages,error", [
    ([{"role": "user", "content": "hi"}], "no assistant"),
    ([{"role": "assistant", "content": "x"}], "must follow a user"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "expected a user"),
])
def test_malformed_conversations_are_rejected(tokenizer, messages, error):
    with pytest.raises(ValueError, match=error):
        tokenize_conversation(ChatTokens(tokenizer), messages)


def test_reply_without_the_prefix_is_rejected(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A</answer>"}]
    with pytest.raises(ValueError, match="response prefix"):
        tokenize_conversation(ChatTokens(tokenizer), messages, response_prefix="<answer>")
