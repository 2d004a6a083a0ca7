"""StarPO's rollout stage: env groups play multi-turn episodes against a generation backend.

Each turn, every unfinished env's token sequence (its whole history) is sent to the
backend in one batch; each reply is parsed, its actions are stepped in the env, and the
env's answer is appended to the sequence. An unparsable reply costs ``format_penalty``
and leaves the env unchanged; an env that raises ends that episode with ``error`` set
(reported, excluded from the update), never the run.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Sequence

import gymnasium as gym

from ragen.agent.context import ChatTokens, PromptFormat
from ragen.agent.parser import parse_response
from ragen.agent.trajectory import Trajectory, Turn
from ragen.models.backend import SamplingParams


@dataclass
class AgentSettings:
    max_turn: int = 1
    max_actions_per_turn: int = 1
    #: 0 = no limit.
    max_actions_per_traj: int = 0
    enable_think: bool = True
    #: Text put after the generation prompt, before the model writes (e.g. "<answer>"); not trained on.
    response_prefix: str = ""
    format_penalty: float = -0.1
    system_prompt: str = "You're a helpful assistant."
    action_sep: str = "||"


@dataclass
class _Episode:
    env: gym.Env
    traj: Trajectory
    messages: list[dict]
    actions_left: int | None
    #: The env's latest observation text (repeated after an invalid answer).
    observation: str = ""


class Rollout:
    """Plays episodes for a batch of envs with one backend and one chat template."""

    def __init__(self, backend, tokenizer, settings: AgentSettings, sampling: SamplingParams):
        self.backend = backend
        self.chat = ChatTokens(tokenizer)
        self.tokenizer = tokenizer
        self.settings = settings
        self.sampling = sampling
        self.format = PromptFormat(settings.enable_think, settings.max_actions_per_turn, settings.action_sep)
        self.prefix_ids = self.chat.encode(settings.response_prefix)

    def run(self, envs: Sequence[gym.Env], seeds: Sequence[int], group_ids: Sequence[int], env_name: str) -> list[Trajectory]:
        """Reset ``envs[i]`` with ``seeds[i]`` and play until every episode ends or ``max_turn``."""
        episodes = [self._start(env, seed, gid, env_name) for env, seed, gid in zip(envs, seeds, group_ids)]
        for turn in range(1, self.settings.max_turn + 1):
            active = [ep for ep in episodes if not ep.traj.done]
            if not active:
                break
            prompts = [ep.traj.input_ids for ep in active]
            if getattr(self.backend, "wants_messages", False):  # chat APIs take messages, not token ids
                generations = self.backend.generate(prompts, self.sampling, messages=[ep.messages for ep in active])
            else:
                generations = self.backend.generate(prompts, self.sampling)
            for ep, gen in zip(active, generations):
                self._take_turn(ep, gen.token_ids, gen.finish_reason, last_turn=turn == self.settings.max_turn)
        return [ep.traj for ep in episodes]

    # -- one episode -------------------------------------------------------------------

    def _start(self, env: gym.Env, seed: int, group_id: int, env_name: str) -> _Episode:
        traj = Trajectory(env_name=env_name, group_id=group_id, seed=seed)
        try:
            observation, _ = env.reset(seed=seed)
        except Exception as exc:  # an env bug must not kill the run
            traj.error, traj.done = f"reset raised {exc!r}\n{traceback.format_exc(limit=3)}", True
            return _Episode(env, traj, [], None)
        limit = self.settings.max_actions_per_traj
        actions_left = limit if limit > 0 else None
        user = self.format.first_user_message(env.unwrapped.instructions, observation, 1, actions_left)
        messages = ([{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else [])
        messages.append({"role": "user", "content": user})
        traj.initial_observation = observation
        self._append(traj, self.chat.prompt_ids(messages) + self.prefix_ids, model_wrote=False)
        return _Episode(env, traj, messages, actions_left, observation)

    def _take_turn(self, ep: _Episode, token_ids: list[int], finish_reason: str, last_turn: bool) -> None:
        traj = ep.traj
        start = len(traj.input_ids)
        self._append(traj, token_ids, model_wrote=True)
        traj.turn_spans.append((start, len(traj.input_ids)))
        text = self.settings.response_prefix + self.tokenizer.decode(token_ids, skip_special_tokens=True)
        parsed = parse_response(
            text,
            enable_think=self.settings.enable_think,
            max_actions=self.settings.max_actions_per_turn,
            action_sep=self.settings.action_sep,
        )
        env = ep.env.unwrapped
        action_ids = [env.parse_action(a) for a in parsed.actions]
        feedback = ""
        if parsed.format_valid and None in action_ids:
            bad = parsed.actions[action_ids.index(None)]
            parsed.format_valid, parsed.error = False, f"unknown action {bad!r}"
        if ep.actions_left is not None:
            action_ids = action_ids[: ep.actions_left]
        turn = Turn(response=text, actions=parsed.actions, format_valid=parsed.format_valid, env_reward=0.0, format_penalty=0.0)
        if parsed.format_valid:
            ep.observation = self._step(ep, action_ids, turn)
        else:
            turn.format_penalty = self.settings.format_penalty
            turn.info["format_error"] = parsed.error
            feedback = f"Your answer was invalid ({parsed.error}); the state did not change."
        observation = turn.observation = ep.observation
        traj.turns.append(turn)
        if ep.actions_left is not None and ep.actions_left <= 0:
            traj.done = True
        if last_turn:
            traj.done = True
        if traj.done:
            return
        next_user = {
            "role": "user",
            "content": self.format.next_user_message(turn.reward, observation, len(traj.turns) + 1, ep.actions_left, feedback),
        }
        ids = self.chat.next_turn_ids(ep.messages, next_user, finish_reason) + self.prefix_ids
        ep.messages += [{"role": "assistant", "content": text}, next_user]
        self._append(traj, ids, model_wrote=False)

    def _step(self, ep: _Episode, action_ids: list[int], turn: Turn) -> str:
        """Step the env with each action in turn; return the final observation text."""
        traj, observation = ep.traj, ep.observation
        for action_id in action_ids:
            try:
                observation, reward, terminated, truncated, info = ep.env.step(action_id)
            except Exception as exc:  # reported in the trajectory and the metrics, not fatal
                traj.error, traj.done = f"step raised {exc!r}\n{traceback.format_exc(limit=3)}", True
                return observation
            turn.env_reward += float(reward)
            turn.info.update({k: v for k, v in info.items() if isinstance(v, (bool, int, float, str))})
            traj.success = bool(info.get("success", False))
            if ep.actions_left is not None:
                ep.actions_left -= 1
            if terminated or truncated:
                traj.done = True
                break
        return observation

    @staticmethod
    def _append(traj: Trajectory, ids: list[int], model_wrote: bool) -> None:
        traj.input_ids.extend(ids)
        traj.loss_mask.extend([int(model_wrote)] * len(ids))
