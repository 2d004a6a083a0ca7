"""A chat conversation → token ids and a loss mask of the assistant's tokens, exactly as the rollout builds them.

No template-specific token is matched: the sequence is assembled with
:class:`ragen.agent.context.ChatTokens`, the code :class:`ragen.agent.Rollout` uses, so an
SFT example is token for token the trajectory the rollout would record if the model wrote
the demonstrated replies:

* the first prompt: ``ChatTokens.prompt_ids`` of the messages before the first reply,
  then the ``response_prefix`` (mask 0: the rollout writes it, not the model);
* each reply: its text after the prefix, encoded (mask 1); with ``train_on_eos`` and a
  template whose assistant turn closes with the EOS (ChatML's ``<|im_end|>``), the EOS id
  too, as if the model had sampled it (mask 1) -- so the model learns to end its turn;
* between replies: ``ChatTokens.next_turn_ids`` (closing, next user message, generation
  prompt) and the prefix again (mask 0).

``tests/sft/test_masking.py`` checks the result equals a real rollout's ids and mask.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragen.agent.context import ChatTokens


@dataclass
class TokenizedExample:
    input_ids: list[int]  # (L,)
    loss_mask: list[int]  # (L,) 1 where the token was written by the assistant

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        return sum(self.loss_mask)


def eos_closes_turn(chat: ChatTokens, messages: list[dict]) -> bool:
    """True if the template closes an assistant turn with the EOS text (then a sampled EOS is the model's)."""
    return chat.closing_ids(messages, "eos") != chat.closing_ids(messages, "stop")


def conversation_problem(messages: list[dict], response_prefix: str = "") -> str | None:
    """Why ``messages`` is not a conversation :func:`tokenize_conversation` can train on, or None (needs no tokenizer).

    It must hold an assistant message; the first one must follow a user message; from there on,
    assistant replies and user messages alternate; every reply starts with ``response_prefix``.
    """
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        return "conversation has no assistant message"
    if first == 0 or messages[first - 1]["role"] != "user":
        return "the first assistant message must follow a user message"
    for k in range(first, len(messages)):
        expected = "assistant" if (k - first) % 2 == 0 else "user"
        role = messages[k]["role"]
        if role != expected:
            what = "an assistant reply" if expected == "assistant" else "a user message after a reply"
            return f"message {k}: expected {what}, got role {role!r}"
        if role == "assistant" and not messages[k]["content"].startswith(response_prefix):
            return f"message {k}: reply does not start with the response prefix {response_prefix!r}"
    return None


def tokenize_conversation(chat: ChatTokens, messages: list[dict], *, response_prefix: str = "",
                          train_on_eos: bool = True) -> TokenizedExample:
    """Ids and loss mask of ``messages`` (system/user messages, then alternating assistant and user).

    Raises ``ValueError`` with :func:`conversation_problem`'s message for a conversation of the wrong shape.
    """
    problem = conversation_problem(messages, response_prefix)
    if problem:
        raise ValueError(problem)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prefix_ids = chat.encode(response_prefix)
    ids = chat.prompt_ids(messages[:first]) + prefix_ids
    mask = [0] * len(ids)
    eos_id = chat.tokenizer.eos_token_id
    k = first
    while k < len(messages):
        content = messages[k]["content"]
        history = messages[:k]  # ends with the user message this reply answers
        written = chat.encode_reply(content[len(response_prefix) :])  # special-token text spelled out
        finish = "stop"
        if train_on_eos and eos_id is not None and eos_closes_turn(chat, history):
            written = written + [eos_id]
            finish = "eos"
        ids += written
        mask += [1] * len(written)
        if k + 1 < len(messages):
            next_user = messages[k + 1]
            between = chat.next_turn_ids(history, next_user, finish) + prefix_ids
            ids += between
            mask += [0] * len(between)
        k += 2
    return TokenizedExample(ids, mask)


__all__ = ["TokenizedExample", "conversation_problem", "tokenize_conversation", "eos_closes_turn"]
