"""Play single-player `TextArena <https://github.com/LeonGuertler/TextArena>`_ games as a ragen env.

TextArena is optional (``pip install textarena``); the env name ``"textarena"`` is registered with the
built-in envs either way (this module imports the package only when an env is made), and
``ragen.envs.make("textarena", game="GuessTheNumber-v0")`` raises a one-line ``ValueError`` when the
package is missing or the game is unknown.

    env = ragen.envs.make("textarena", game="GuessTheNumber-v0")

Mapping onto the ragen contract:

* the game's own prompt (its ``PROMPT`` observation) becomes ``instructions``; each
  turn's observation is the game's messages since the previous turn (hints, the board,
  "invalid move" notices), not the whole history, since the chat already holds it;
* answers are free text, so the env keeps *pending answers*: ``parse_action(text)`` appends
  the text to a queue and returns the fixed id ``1``; each ``step(1)`` sends the oldest queued
  answer to the game (an empty move if none). A queue, not one slot, because the rollout
  parses all actions of a turn (``agent.max_actions_per_turn``) before stepping any;
  ``reset`` empties it. With ``bracket_actions`` (default) an answer without ``[`` is wrapped in
  brackets (``5`` -> ``[5]``), as TextArena's ``ActionFormattingWrapper`` does;
* the reward is TextArena's final reward for player 0, given on the last step (0 before);
  ``success`` is a reward of at least ``success_reward`` (1.0, a win);
* ``action_is_valid`` is False when the game rejected the move;
* randomness: TextArena games draw from Python's *global* ``random`` (seeded by the game's
  ``reset``, drawn while playing: Minesweeper places its mines at the first move). Each env
  keeps its own ``random`` state and swaps it in only around the game's ``reset`` and
  ``step``, restoring the caller's afterwards, so an episode is a function of its seed and
  actions alone (envs stepped in turn do not disturb each other) and the caller's global
  ``random`` stream is left as it was.

Only single-player games are supported (multi-player games need opponents; TextArena's
``reset`` raises for them, and so does ``make``).
"""

from __future__ import annotations

import random
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from gymnasium import spaces

from ragen.envs.base import TextEnv, build_config
from ragen.envs.registry import register
from ragen.envs.render import check_render_mode

SUBMIT = 1
_CHARSET = frozenset("".join(chr(c) for c in range(32, 127)) + "\n\t" + "".join(chr(c) for c in range(0xA0, 0x2600)))


def _import_textarena():
    try:
        import textarena
    except ImportError:
        raise ValueError("textarena: needs the optional 'textarena' package (pip install textarena)") from None
    return textarena


@register("textarena")
class TextArenaEnv(TextEnv):
    """A single-player TextArena game (``game``, e.g. ``"GuessTheNumber-v0"``), one answer per step."""

    description = "TextArena: any single-player TextArena game (optional package), free-text answers."
    action_lookup = {SUBMIT: "submit"}
    action_space = spaces.Discrete(1, start=1)
    observation_space = spaces.Text(min_length=0, max_length=200_000, charset=_CHARSET)

    @dataclass
    class Config:
        game: str = "GuessTheNumber-v0"
        bracket_actions: bool = True
        success_reward: float = 1.0

    def __init__(self, render_mode: str | None = None, **cfg: Any):
        self.config = build_config(self.Config, cfg, "textarena")
        self.render_mode = check_render_mode("textarena", render_mode, self.metadata["render_modes"])
        ta = _import_textarena()
        self._ta = ta
        game = self.config.game
        base = game if game.endswith("-raw") else f"{game}-raw"  # raw: no wrappers; we format ourselves
        try:
            self.game = ta.make(env_id=base)
        except Exception as exc:  # ValueError (unknown id), ImportError (a game's own missing dependency)
            raise ValueError(f"textarena: cannot make game {game!r}: {exc}") from None
        self.instructions = f"You are playing the TextArena game {game}."
        self.observation = ""
        self._pending_answers: deque[str] = deque()
        self._random_state: tuple | None = None
        self._done = True

    def parse_action(self, text: str) -> int | None:
        """Queue ``text`` as a pending answer and return the submit id (None for blank text)."""
        if not isinstance(text, str) or not text.strip():
            return None
        self._pending_answers.append(text)
        return SUBMIT

    @contextmanager
    def _own_random(self, seed: int | None = None) -> Iterator[None]:
        """Run the block on this env's Python ``random`` state, then give the caller's state back.

        TextArena seeds and draws from the global ``random``; swapping states keeps each game's draws its own.
        With ``seed`` (at ``reset``) the env's state starts afresh from it, whatever came before.
        """
        caller_state = random.getstate()
        if seed is not None:
            random.seed(seed)
        elif self._random_state is not None:
            random.setstate(self._random_state)
        try:
            yield
        finally:
            self._random_state = random.getstate()
            random.setstate(caller_state)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        # TextArena seeds Python's global ``random`` itself when given a seed; without one,
        # draw it from np_random so that gymnasium's seeding still decides the game.
        ta_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        try:
            with self._own_random(seed=ta_seed):
                self.game.reset(num_players=1, seed=ta_seed)
        except AssertionError as exc:
            raise ValueError(f"textarena: {self.config.game!r} is not a single-player game ({exc})") from None
        prompt, rest, _ = self._drain()
        if prompt:
            self.instructions = prompt
        self.observation = rest or "Make your first move."
        self._pending_answers.clear()
        self._done = False
        return self.observation, {"game": self.config.game}

    def step(self, action):
        action = self.check_action(action)
        if self._done:
            raise ValueError("textarena: episode is over; call reset()")
        answer = self._pending_answers.popleft() if self._pending_answers else ""
        if self.config.bracket_actions and "[" not in answer:
            answer = f"[{answer.strip()}]"
        with self._own_random():
            done, _ = self.game.step(action=answer)
        _, text, invalid = self._drain()
        reward, success, reason = 0.0, False, ""
        if done:
            with self._own_random():
                rewards, game_info = self.game.close()
            reward = float((rewards or {}).get(0, 0.0))
            success = reward >= self.config.success_reward
            info0 = (game_info or {}).get(0, {})
            reason = str(info0.get("reason", ""))
            invalid = invalid or bool(info0.get("invalid_move", False))
            text = "\n".join(part for part in (text, reason) if part)
        self.observation = text
        self._done = done
        info = {"success": success, "action_is_valid": not invalid, "action_is_effective": not invalid}
        return self.observation, reward, bool(done), False, info

    def render(self) -> str:
        return self.observation

    def _drain(self) -> tuple[str, str, bool]:
        """(the game's prompt if any, its other messages joined, whether a move was rejected)."""
        kinds = self._ta.ObservationType
        _, messages = self.game.get_observation()
        prompt, lines, invalid = "", [], False
        for _, message, kind in messages or []:
            if kind == kinds.PROMPT:
                prompt = str(message).strip()
            elif kind == kinds.PLAYER_ACTION:
                continue
            else:
                if kind == kinds.GAME_ADMIN:
                    invalid = True
                lines.append(str(message).strip())
        return prompt, "\n".join(line for line in lines if line), invalid

