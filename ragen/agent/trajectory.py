"""The ``Trajectory`` record: one env's multi-turn episode as the exact token ids the model saw and wrote."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Turn:
    """One model turn: what it wrote, how it parsed, what the env answered."""

    response: str
    actions: list[str]
    format_valid: bool
    env_reward: float
    format_penalty: float
    observation: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    #: Shaped reasoning rewards (``agent.think_reward``, ``agent.prediction_reward``); never part of success.
    think_reward: float = 0.0
    prediction_reward: float = 0.0
    #: Whether the turn's ``<prediction>`` equalled the next observation (None: not asked or not scored).
    prediction_correct: bool | None = None
    #: Actions the env executed this turn, and how many of them changed its state.
    actions_executed: int = 0
    actions_effective: int = 0

    @property
    def task_reward(self) -> float:
        """What the task paid: env reward plus format penalty."""
        return self.env_reward + self.format_penalty

    @property
    def reward(self) -> float:
        """The training reward: the task reward plus the shaped reasoning rewards."""
        return self.task_reward + self.think_reward + self.prediction_reward


@dataclass
class Trajectory:
    """A whole episode. ``input_ids[i]`` was written by the model iff ``loss_mask[i] == 1``.

    ``input_ids`` are the ids actually fed to / sampled from the model, never re-tokenised
    text; ``turn_spans[k] = (start, end)`` delimits turn ``k``'s model-written tokens.
    """

    env_name: str
    group_id: int
    seed: int
    #: The env tag the episode was played under (``env_name`` when the run uses no tags).
    tag: str = ""
    #: The env's place in its group, passed to ``reset`` as ``options["group_member"]`` (``ragen.envs.base``).
    group_member: int = 0
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    initial_observation: str = ""
    success: bool = False
    done: bool = False
    #: Set when the env raised: the episode is reported and left out of the update.
    error: str = ""
    #: Set when the episode ended early because its next prompt would not fit the model's context (the turns played
    #: count and train, as when ``max_turn`` ends an episode): why, with the lengths.
    context_full: str = ""
    #: ``agent.context_mode=window`` only: ``window_prompts[k]`` are the exact ids turn ``k`` was
    #: generated from (instructions + the last turns); the turn's training sample is
    #: ``window_prompts[k] + input_ids[turn_spans[k][0]:turn_spans[k][1]]``. ``input_ids`` still
    #: holds the whole episode (for advantages, the viewer and SFT).
    window_prompts: list[list[int]] = field(default_factory=list)

    @property
    def reward(self) -> float:
        """Training return: env rewards, format penalties and any shaped reasoning rewards."""
        return sum(t.reward for t in self.turns)

    @property
    def task_reward(self) -> float:
        """Task return: env rewards plus format penalties, without reasoning-reward shaping."""
        return sum(t.task_reward for t in self.turns)

    @property
    def num_actions(self) -> int:
        """Actions the env executed (as the baselines count them), not the ones the model wrote: actions past
        ``max_actions_per_traj`` or after the episode ended mid-turn are not run."""
        return sum(t.actions_executed for t in self.turns)

    @property
    def response_length(self) -> int:
        return sum(self.loss_mask)

    def to_json(self) -> dict[str, Any]:
        return {
            "env": self.env_name,
            "tag": self.tag or self.env_name,
            "group_id": self.group_id,
            "seed": self.seed,
            "group_member": self.group_member,
            "reward": self.reward,
            "task_reward": self.task_reward,
            "success": self.success,
            "error": self.error,
            "context_full": self.context_full,
            "initial_observation": self.initial_observation,
            "turns": [
                {
                    "response": t.response,
                    "actions": t.actions,
                    "format_valid": t.format_valid,
                    "env_reward": t.env_reward,
                    "format_penalty": t.format_penalty,
                    "think_reward": t.think_reward,
                    "prediction_reward": t.prediction_reward,
                    "observation": t.observation,
                }
                for t in self.turns
            ],
        }
