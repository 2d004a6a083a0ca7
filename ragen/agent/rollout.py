"""StarPO's rollout stage: env groups play multi-turn episodes against a generation backend.

Each turn, every unfinished env's token sequence (its whole history) is sent to the
backend in one batch; each reply is parsed, its actions are stepped in the env, and the
env's answer is appended to the sequence. An unparsable reply costs ``format_penalty``
and leaves the env unchanged; an env that raises ends that episode with ``error`` set
(reported, excluded from the update), never the run.

Episodes of one batch may come from different env tags: each carries its own
:class:`AgentConfig` (horizon, prompt, format), so a 1-turn Bandit episode finishes while
a 5-turn Sokoban episode of the same batch keeps playing.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Sequence

import gymnasium as gym
import numpy as np

from ragen.agent.context import ChatTokens, PromptFormat
from ragen.agent.parser import ParsedResponse, parse_response
from ragen.agent.settings import AgentConfig
from ragen.agent.rewards import extract_prediction, prediction_matches, think_is_well_formed
from ragen.agent.trajectory import Trajectory, Turn
from ragen.envs.base import GROUP_MEMBER_OPTION
from ragen.envs.contract import (EnvContractError, checked_action_id, checked_reset, describe_failure,
                                  instructions_problem, stepped)
from ragen.engines.base import SamplingParams, engine_session


class _Protocol:
    """What one :class:`AgentConfig` implies for prompts: its wording and its response prefix ids."""

    def __init__(self, settings: AgentConfig, chat: ChatTokens):
        self.settings = settings
        self.format = PromptFormat(
            settings.enable_think, settings.max_actions_per_turn, settings.action_sep,
            predict_state=settings.prediction_reward != 0,
        )
        self.prefix_ids = chat.encode(settings.response_prefix)


def through_stop(text: str, stops) -> str:
    """``text`` up to the end of its first stop string: what generation stopped at. The token completing a stop string
    may carry more characters (``>.`` after ``</answer``): they are not part of the answer."""
    ends = [text.find(s) + len(s) for s in stops or () if s and s in text]
    return text[: min(ends)] if ends else text


@dataclass
class _Episode:
    env: gym.Env
    traj: Trajectory
    messages: list[dict]
    actions_left: int | None
    protocol: _Protocol
    #: The env's latest observation text (repeated after an invalid answer).
    observation: str = ""
    #: The env's instructions as the first prompt gave them (repeated atop every window prompt).
    instructions: str = ""

    @property
    def windowed(self) -> bool:
        return self.settings.context_mode == "window"

    def prompt_ids(self) -> list[int]:
        """What the model sees this turn: the whole sequence so far, or this turn's window prompt."""
        return self.traj.window_prompts[-1] if self.windowed else self.traj.input_ids

    def prompt_messages(self) -> list[dict]:
        """The chat messages behind :meth:`prompt_ids` (for backends that take messages)."""
        return window_messages(self.messages, self.settings.max_context_window, self.header) if self.windowed else self.messages

    @property
    def header(self) -> str:
        """The first prompt's preamble: the env's rules and the answer format."""
        return self.protocol.format.preamble(self.instructions)

    @property
    def settings(self) -> AgentConfig:
        return self.protocol.settings


class Rollout:
    """Plays episodes for a batch of envs with one backend and one chat template.

    ``settings`` is the default for every episode; :meth:`run` may give each env its own
    (mixed env tags). ``max_in_flight`` > 0 plays a run's multi-turn episodes in waves of at most that many
    (each wave to its end, with its own kept KV caches), which bounds the caches' memory without
    re-encoding anything; 0 plays them all at once. A run whose episodes all end after one turn keeps nothing
    between turns and plays at once whatever ``max_in_flight`` says.
    """

    def __init__(self, backend, tokenizer, settings: AgentConfig, sampling: SamplingParams, max_in_flight: int = 0):
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.backend = backend
        self.chat = ChatTokens(tokenizer)
        self.tokenizer = tokenizer
        self.settings = settings
        self.sampling = sampling
        self._protocols: dict[int, _Protocol] = {}
        default = self._protocol(settings)
        self.format, self.prefix_ids = default.format, default.prefix_ids

    def _protocol(self, settings: AgentConfig) -> _Protocol:
        """One :class:`_Protocol` per distinct settings object (prefix ids are encoded once)."""
        key = id(settings)
        if key not in self._protocols or self._protocols[key].settings is not settings:
            self._protocols[key] = _Protocol(settings, self.chat)
        return self._protocols[key]

    def run(
        self,
        envs: Sequence[gym.Env],
        seeds: Sequence[int],
        group_ids: Sequence[int],
        env_name: str | Sequence[str],
        *,
        settings: Sequence[AgentConfig] | None = None,
        tags: Sequence[str] | None = None,
    ) -> list[Trajectory]:
        """Reset ``envs[i]`` with ``seeds[i]`` and play until every episode ends or reaches its ``max_turn``.

        ``env_name`` names every env (one string) or each one; ``settings[i]`` (default: the
        rollout's) and ``tags[i]`` (default: the env name) belong to ``envs[i]``. Episodes with
        different horizons share each turn's batched ``generate`` call while they last (within a
        wave, see ``max_in_flight``). Each env is reset with ``options={"group_member": j}``, ``j``
        its place among this call's envs of the same group id (``group_members``).
        """
        n = len(envs)
        names = [env_name] * n if isinstance(env_name, str) else list(env_name)
        per_env = list(settings) if settings is not None else [self.settings] * n
        tag_names = list(tags) if tags is not None else names
        if not len(names) == len(per_env) == len(tag_names) == len(seeds) == len(group_ids) == n:
            raise ValueError("Rollout.run: envs, seeds, group_ids, env names, settings and tags must have one entry per env")
        members = group_members(group_ids)
        episodes = [
            self._start(env, seed, gid, member, name, self._protocol(s), tag)
            for env, seed, gid, member, name, s, tag in zip(envs, seeds, group_ids, members, names, per_env, tag_names)
        ]
        multi_turn = any(s.max_turn > 1 for s in per_env)
        wave = (self.max_in_flight if multi_turn else 0) or max(n, 1)
        for start in range(0, n, wave):
            self._play(episodes[start : start + wave])
        return [ep.traj for ep in episodes]

    def _play(self, episodes: list[_Episode]) -> None:
        """Turns for ``episodes`` until each has ended, one batched ``generate`` call per turn."""
        with self._session(episodes):
            while True:
                active = [ep for ep in self._within_context(ep for ep in episodes if not ep.traj.done)]
                if not active:
                    break
                prompts = [ep.prompt_ids() for ep in active]
                if getattr(self.backend, "wants_messages", False):  # chat APIs take messages, not token ids
                    messages = [self.chat.escaped(ep.prompt_messages()) for ep in active]  # as the template would be
                    generations = self.backend.generate(prompts, self.sampling, messages=messages)
                else:
                    generations = self.backend.generate(prompts, self.sampling)
                for ep, gen in zip(active, generations):
                    last_turn = len(ep.traj.turns) + 1 >= ep.settings.max_turn
                    self._take_turn(ep, gen.token_ids, gen.finish_reason, last_turn=last_turn)

    def _within_context(self, episodes) -> list[_Episode]:
        """``episodes`` whose next prompt leaves room for ``max_new_tokens`` in the model's context.

        The model would otherwise read positions it was never trained on (and a huge observation stalls the prefill
        for minutes). An episode whose first prompt does not fit ends with an error (nothing was played); one whose
        later prompt does not fit ends there, its turns kept as when ``max_turn`` ends it, with ``context_full``
        saying why."""
        limit = context_limit(self.backend)
        kept = []
        for ep in episodes:
            length = len(ep.prompt_ids())
            if not limit or length + self.sampling.max_new_tokens <= limit:
                kept.append(ep)
                continue
            traj = ep.traj
            why = (f"turn {len(traj.turns) + 1}: the prompt of {length} tokens plus rollout.max_new_tokens="
                   f"{self.sampling.max_new_tokens} exceeds the model's context of {limit} tokens")
            traj.done = True
            if not traj.turns:
                traj.error = (f"{why} (shorter observations or instructions, or a lower rollout.max_new_tokens, "
                              "keep it within)")
                continue
            traj.context_full = (f"{why}: the episode ended after turn {len(traj.turns)} (fewer turns "
                                 "(agent.max_turn), agent.context_mode=window or a lower rollout.max_new_tokens keep it within)")
            end = traj.turn_spans[-1][1]  # drop the next prompt's tokens: the episode ends as at its last turn
            del traj.input_ids[end:], traj.loss_mask[end:]
            del traj.window_prompts[len(traj.turns):]
        return kept

    def _session(self, episodes: list[_Episode]):
        """The engine's scope for this run (the HF engine keeps KV caches between turns when ``full`` prompts extend
        each other); a no-op for engines without one."""
        multi_turn_full = any(not ep.windowed and ep.settings.max_turn > 1 for ep in episodes)
        return engine_session(self.backend, keep_kv=multi_turn_full)

    # -- one episode -------------------------------------------------------------------

    def _start(
        self, env: gym.Env, seed: int, group_id: int, member: int, env_name: str, protocol: _Protocol, tag: str
    ) -> _Episode:
        settings = protocol.settings
        traj = Trajectory(env_name=env_name, group_id=group_id, seed=seed, tag=tag, group_member=member)
        try:
            observation, _ = checked_reset(env, env.reset(seed=seed, options={GROUP_MEMBER_OPTION: member}))
            instructions = settings.instructions or getattr(env.unwrapped, "instructions", None)
            problem = instructions_problem(env, instructions)
            if problem:
                raise EnvContractError(problem)
        except Exception as exc:  # an env bug must not kill the run
            _env_failed(traj, "reset", exc)
            return _Episode(env, traj, [], None, protocol)
        limit = settings.max_actions_per_traj
        actions_left = limit if limit > 0 else None
        user = protocol.format.first_user_message(instructions, observation, 1, actions_left)
        messages = ([{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else [])
        messages.append({"role": "user", "content": user})
        traj.initial_observation = observation
        self._append(traj, self.chat.prompt_ids(messages) + protocol.prefix_ids, model_wrote=False)
        episode = _Episode(env, traj, messages, actions_left, protocol, observation, instructions)
        if episode.windowed:  # the first window is the first prompt itself
            traj.window_prompts.append(traj.input_ids[:])
        return episode

    def _take_turn(self, ep: _Episode, token_ids: list[int], finish_reason: str, last_turn: bool) -> None:
        traj, settings = ep.traj, ep.settings
        start = len(traj.input_ids)
        self._append(traj, token_ids, model_wrote=True)
        traj.turn_spans.append((start, len(traj.input_ids)))
        text = settings.response_prefix + self.tokenizer.decode(token_ids, skip_special_tokens=True)
        # the end token the model sampled (it may have several): the next prompt's closing leaves out that one
        sampled_eos = self.tokenizer.decode(token_ids[-1:]) if finish_reason == "eos" and token_ids else None
        parsed = parse_response(
            through_stop(text, self.sampling.stop) if finish_reason == "stop" else text,
            enable_think=settings.enable_think,
            max_actions=settings.max_actions_per_turn,
            action_sep=settings.action_sep,
        )
        env = ep.env.unwrapped
        try:
            action_ids = [checked_action_id(env, a, env.parse_action(a)) for a in parsed.actions]
        except Exception as exc:  # the episode ends with the error; its turn is still recorded
            _env_failed(traj, "parse_action", exc)
            action_ids = []
        feedback = ""
        if parsed.format_valid and None in action_ids:
            bad = parsed.actions[action_ids.index(None)]
            parsed.format_valid, parsed.error = False, f"unknown action {bad!r}"
        if ep.actions_left is not None:
            action_ids = action_ids[: ep.actions_left]
        turn = Turn(response=text, actions=parsed.actions, format_valid=parsed.format_valid, env_reward=0.0, format_penalty=0.0)
        if traj.error:  # parse_action failed: nothing is stepped, and the episode ends with its error
            pass
        elif parsed.format_valid:
            ep.observation = self._step(ep, action_ids, turn)
        else:
            turn.format_penalty = malformed_turn_penalty(settings, env, ep.actions_left)
            turn.info["format_error"] = parsed.error
            feedback = f"Your answer was invalid ({parsed.error}); the state did not change."
        observation = turn.observation = ep.observation
        if not traj.error:
            self._shape(turn, parsed, settings)
        traj.turns.append(turn)
        if ep.actions_left is not None and ep.actions_left <= 0:
            traj.done = True
        if last_turn:
            traj.done = True
        if traj.done:
            return
        next_user = {
            "role": "user",
            "content": ep.protocol.format.next_user_message(
                turn.task_reward, observation, len(traj.turns) + 1, ep.actions_left, feedback
            ),
        }
        ids = self.chat.next_turn_ids(ep.messages, next_user, finish_reason, sampled_eos) + ep.protocol.prefix_ids
        ep.messages += [{"role": "assistant", "content": text}, next_user]
        self._append(traj, ids, model_wrote=False)
        if ep.windowed:
            traj.window_prompts.append(self.chat.prompt_ids(ep.prompt_messages()) + ep.protocol.prefix_ids)

    def _step(self, ep: _Episode, action_ids: list[int], turn: Turn) -> str:
        """Step the env with each action in turn; return the final observation text."""
        traj, observation = ep.traj, ep.observation
        steps = stepped(ep.env, action_ids)
        while True:
            try:
                result = next(steps, None)
            except Exception as exc:  # reported in the trajectory and the metrics, not fatal
                _env_failed(traj, "step", exc)
                return observation
            if result is None:
                return observation
            observation, reward, terminated, truncated, info = result
            effective, success = bool(info.get("action_is_effective", True)), bool(info.get("success", False))
            turn.env_reward += reward
            turn.actions_executed += 1
            turn.actions_effective += int(effective)
            turn.info.update(plain_info(info))
            traj.success = success
            if ep.actions_left is not None:
                ep.actions_left -= 1
            if terminated or truncated:
                traj.done = True

    @staticmethod
    def _shape(turn: Turn, parsed: ParsedResponse, settings: AgentConfig) -> None:
        """Add the shaped reasoning rewards (:mod:`ragen.agent.rewards`) to a finished turn.

        Only a valid answer can earn them; the prediction is compared with the observation
        the env returned after this turn's actions (``turn.observation``).
        """
        if settings.think_reward and think_is_well_formed(parsed.format_valid, parsed.think):
            turn.think_reward = settings.think_reward
        if settings.prediction_reward and parsed.format_valid:
            turn.prediction_correct = prediction_matches(extract_prediction(parsed.think), turn.observation)
            turn.prediction_reward = settings.prediction_reward if turn.prediction_correct else 0.0

    @staticmethod
    def _append(traj: Trajectory, ids: list[int], model_wrote: bool) -> None:
        traj.input_ids.extend(ids)
        traj.loss_mask.extend([int(model_wrote)] * len(ids))


def context_limit(backend) -> int | None:
    """The most tokens (prompt + answer) ``backend``'s model takes, if it says (``backend.context_limit``); else None."""
    limit = getattr(backend, "context_limit", None)
    return int(limit) if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def _env_failed(traj: Trajectory, method: str, exc: BaseException) -> None:
    """End ``traj`` with the error of an env call (reported in the trajectory and the metrics, not fatal to the run):
    a broken contract's own sentence, or the exception with the last frames of its traceback."""
    text = describe_failure(method, exc)
    if not isinstance(exc, EnvContractError):
        text += "\n" + "".join(traceback.format_exception(exc, limit=-3))
    traj.error, traj.done = text, True


def plain_info(info: dict) -> dict:
    """The entries of a ``step`` info that a turn keeps (logged, ``metric/*`` averaged): text, bools and real numbers,
    NumPy scalars as their Python values (``np.float32(0.5)`` -> ``0.5``)."""
    out = {}
    for key, value in info.items():
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, (bool, int, float, str)):
            out[key] = value
    return out


def malformed_turn_penalty(settings: "AgentConfig", env, actions_left: int | None) -> float:
    """What a turn whose answer does not parse costs: ``format_penalty``, plus the env's ``idle_action_reward`` for every
    action the turn could have taken (Sokoban: −0.1 a step). So a malformed turn always costs more than a well-formed
    turn of useless moves, and RL cannot learn to answer malformed to dodge step penalties."""
    budget = settings.max_actions_per_turn if actions_left is None else min(settings.max_actions_per_turn, actions_left)
    idle = float(getattr(env, "idle_action_reward", 0.0) or 0.0)
    return settings.format_penalty + max(0, budget) * min(0.0, idle)


def group_members(group_ids: Sequence[int]) -> list[int]:
    """Each env's place within its group, in call order: ``[7, 7, 9, 7] -> [0, 1, 0, 2]``.

    Envs of a group share a seed and so the start state; an env may use its place to give each
    member its own draw of what happens after the start (Bandit's ``own_payoff_draw``), never a
    different start.
    """
    seen: dict[int, int] = {}
    members = []
    for gid in group_ids:
        members.append(seen.get(gid, 0))
        seen[gid] = members[-1] + 1
    return members


def window_messages(messages: list[dict], window: int, header: str) -> list[dict]:
    """A ``window`` prompt's messages: the system message, then the last ``window`` turns
    (user + assistant pairs) and the current user message.

    ``messages`` is the whole conversation, ending with the user message to answer. When the
    first user message falls outside the window, ``header`` (the env's rules and the answer
    format) is put atop the oldest kept user message, so every prompt states the task.
    """
    system = [m for m in messages[:1] if m["role"] == "system"]
    dialogue = messages[len(system):]
    kept = dialogue[-(2 * window + 1):]
    if len(kept) < len(dialogue):
        kept = [{**kept[0], "content": f"{header}\n\n{kept[0]['content']}"}] + kept[1:]
    return system + kept
