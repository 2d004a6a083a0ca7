"""Single-answer tasks: the agent's whole answer text is its one action, graded once (Countdown, MathQA).

``parse_action`` keeps the text and returns the one action id, ``SUBMIT``; ``step(SUBMIT)`` grades the kept text
with the subclass's :meth:`AnswerEnv.grade` and ends the episode. The env keeps the answer because the rollout
and the gymnasium API pass action ids, not text, to ``step``.
"""

from __future__ import annotations

from typing import Any

from gymnasium import spaces

from ragen.envs.base import TextEnv

#: The one action of a single-answer env: submit the text ``parse_action`` was given.
SUBMIT = 1


class AnswerEnv(TextEnv):
    """A task answered once. Subclasses set ``name``, draw the task in ``reset`` (calling :meth:`begin_answer`),
    implement :meth:`grade` and :meth:`task_text`."""

    #: The env's registered name, for its error messages.
    name = "answer"
    action_lookup = {SUBMIT: "submit"}
    action_space = spaces.Discrete(1, start=1)

    def begin_answer(self) -> None:
        """A fresh episode: no answer kept, no verdict, the answer still to give."""
        self._pending_answer: str | None = None
        self._verdict = ""
        self._done = False

    def parse_action(self, text: str) -> int | None:
        """Keep ``text`` as the answer and return ``SUBMIT`` (None for blank text)."""
        if not isinstance(text, str) or not text.strip():
            return None
        self._pending_answer = text
        return SUBMIT

    def grade(self, answer: str) -> tuple[float, str, dict[str, Any]]:
        """``(reward, verdict shown after the task, info)`` for ``answer``; info has ``success``,
        ``action_is_valid`` and ``action_is_effective``."""
        raise NotImplementedError

    def task_text(self) -> str:
        """The task as the observation states it ("" before the first reset)."""
        raise NotImplementedError

    def step(self, action):
        self.check_action(action)
        if getattr(self, "_done", True):
            raise ValueError(f"{self.name}: episode is over; call reset()")
        answer, self._pending_answer = self._pending_answer or "", None
        reward, self._verdict, info = self.grade(answer)
        self._done = True
        return self.render(), reward, True, False, info

    def render(self) -> str:
        text = self.task_text()
        if not text:
            return ""
        return f"{text}\n{self._verdict}" if self._verdict else text
