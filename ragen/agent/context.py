"""Turn env observations into chat messages, and chat messages into exact token ids.

:class:`ChatTokens` works with any chat template and never matches template-specific
tokens. It renders the template as text and takes *differences* between renderings:

* the first prompt is ``render(messages, add_generation_prompt=True)``;
* after the model answered, the tokens it sampled are kept as they are; then come the
  template's closing text for an assistant turn (``<|im_end|>\\n`` for ChatML) minus
  whatever of it the model already wrote (its EOS), then the next user message and the
  generation prompt. Those parts are found by rendering a conversation whose assistant
  turn holds a placeholder, and reading the text around the placeholder.

Only the model-written ids get ``loss_mask = 1``; everything the template or the env
added gets 0. Because the model's ids are never re-tokenised, training sees exactly the
sequence that was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

_PLACEHOLDER = "RAGENASSISTANTPLACEHOLDER"
#: Invisible, and not part of any special token: it splits one where untrusted text spells it (:meth:`ChatTokens.escape`).
WORD_JOINER = "\u2060"


class ChatTokens:
    """Builds multi-turn token sequences through ``tokenizer``'s own chat template."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; ragen renders every prompt through one")
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token
        self.eos_text = eos if isinstance(eos, str) else ""
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = set(getattr(tokenizer, "all_special_tokens", []) or []) | {t.content for t in added.values() if t.special}
        #: Special tokens' texts, longest first: in a message's content they are escaped (:meth:`escape`).
        self.special_texts = sorted((t for t in special if isinstance(t, str) and len(t) > 1), key=len, reverse=True)

    def escape(self, text: str) -> str:
        """``text`` with every special token's text broken by a WORD JOINER (U+2060) after its first character.

        The rendered prompt is encoded as one string, and a tokenizer turns the text of a special token into that
        token wherever it appears: an observation (or a model's answer quoted back) holding ``<|im_end|>`` would
        otherwise close the turn and open new ones for real (prompt injection through the env). Escaped, the
        characters stay visible and encode as ordinary text."""
        for token in self.special_texts:
            if token in text:
                text = text.replace(token, token[0] + WORD_JOINER + token[1:])
        return text

    def escaped(self, messages: list[dict]) -> list[dict]:
        """``messages`` with user and assistant contents escaped (:meth:`escape`); the system prompt (the run's own
        config) as written. What every prompt is rendered from, and what a chat API backend is sent."""
        return [m if m.get("role") == "system" or not isinstance(m.get("content"), str)
                else {**m, "content": self.escape(m["content"])} for m in messages]

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The chat template's text for :meth:`escaped` ``messages``."""
        return self.tokenizer.apply_chat_template(self.escaped(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def encode_reply(self, text: str) -> list[int]:
        """Ids a model writes to produce ``text``: special-token text (``<|im_end|>`` spelled out in a reply) as the
        ordinary tokens that spell it, not as the special token, which would end the turn in a rollout (the
        backend cuts at the first end token). Decodes back to ``text``; other text encodes as :meth:`encode` does."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of the first prompt: every message so far, then the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def _assistant_closing(self, messages: list[dict]) -> tuple[str, str]:
        """(text the template puts after an assistant message, rendering up to and including it)."""
        with_reply = self.render(messages + [{"role": "assistant", "content": _PLACEHOLDER}], add_generation_prompt=False)
        at = with_reply.rindex(_PLACEHOLDER) + len(_PLACEHOLDER)
        return with_reply[at:], with_reply

    def _without_sampled_eos(self, text: str, finish_reason: str, sampled_eos: str | None) -> str:
        """``text`` (what the template puts after a reply) without the end token the model already sampled.

        ``sampled_eos`` is the text of the token the model ended on (a model may have several end tokens, e.g.
        ``<|im_end|>`` and ``<|endoftext|>``: ``generation_config.eos_token_id`` lists them); None means the
        tokenizer's ``eos_token``. Only a closing that starts with that very text loses it."""
        eos = self.eos_text if sampled_eos is None else sampled_eos
        if finish_reason == "eos" and eos and text.startswith(eos):
            return text[len(eos) :]
        return text

    def closing_ids(self, messages: list[dict], finish_reason: str, sampled_eos: str | None = None) -> list[int]:
        """Ids that close the assistant turn after the model's own tokens.

        ``messages`` ends with the user message the model answered. If the model sampled
        EOS (``finish_reason == "eos"``) and the template's closing starts with that EOS's
        text (``sampled_eos``; default the tokenizer's ``eos_token``), that part is the model's and is not added again.
        """
        closing, _ = self._assistant_closing(messages)
        return self.encode(self._without_sampled_eos(closing, finish_reason, sampled_eos))

    def next_turn_ids(self, messages: list[dict], next_user: dict, finish_reason: str,
                      sampled_eos: str | None = None) -> list[int]:
        """Ids after the model's reply: close its turn, add ``next_user``, open the next reply (``sampled_eos`` as in
        :meth:`closing_ids`)."""
        following = self.render(
            messages + [{"role": "assistant", "content": _PLACEHOLDER}, next_user], add_generation_prompt=True
        )
        at = following.rindex(_PLACEHOLDER) + len(_PLACEHOLDER)
        return self.encode(self._without_sampled_eos(following[at:], finish_reason, sampled_eos))


@dataclass
class PromptFormat:
    """How observations are worded for the model (RAGEN's prompt, configurable)."""

    enable_think: bool = True
    max_actions_per_turn: int = 1
    action_sep: str = "||"
    #: Ask for ``<prediction>next state</prediction>`` inside ``<think>`` (the world-modelling reward).
    predict_state: bool = False

    def format_instruction(self) -> str:
        if self.enable_think and self.predict_state:
            shape = "<think>...<prediction>...</prediction></think><answer>...</answer>"
        elif self.enable_think:
            shape = "<think>...</think><answer>...</answer>"
        else:
            shape = "<answer>...</answer>"
        many = (
            f" You may give up to {self.max_actions_per_turn} actions, separated by {self.action_sep}."
            if self.max_actions_per_turn > 1
            else ""
        )
        predict = (
            " In <prediction> write the state you expect after your actions, exactly as the state is shown."
            if self.enable_think and self.predict_state
            else ""
        )
        return f"Answer format: {shape}{many}{predict}"

    def preamble(self, instructions: str) -> str:
        """What the first prompt states before the first state: the env's rules and the answer format."""
        return f"{instructions}\n{self.format_instruction()}"

    def first_user_message(self, instructions: str, observation: str, turn: int, actions_left: int | None) -> str:
        return f"{self.preamble(instructions)}\n\n{self.turn_text(observation, turn, actions_left)}"

    def next_user_message(self, reward: float, observation: str, turn: int, actions_left: int | None, feedback: str = "") -> str:
        note = f"{feedback}\n" if feedback else ""
        return f"{note}Reward: {reward:g}\n{self.turn_text(observation, turn, actions_left)}"

    @staticmethod
    def turn_text(observation: str, turn: int, actions_left: int | None) -> str:
        left = f"\nYou have {actions_left} actions left." if actions_left is not None else ""
        return f"Turn {turn}:\nState:\n{observation}{left}"
