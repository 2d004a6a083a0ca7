"""How the agent talks to an env: turns, actions per answer, the asked format, shaped rewards and context.

The ``agent`` section of a run config (``ragen config --list``); the rollout reads one per episode (an env tag may
change some fields for its episodes: ``ragen/agent/env_sets.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AgentConfig:
    #: Maximum model turns per episode.
    max_turn: int = 1
    #: Actions the model may give in one answer, separated by ``action_sep``.
    max_actions_per_turn: int = 1
    #: Actions per episode at most (0 = no limit).
    max_actions_per_traj: int = 0
    #: Ask for ``<think>…</think><answer>…</answer>``; False asks for ``<answer>…</answer>`` only.
    enable_think: bool = True
    #: Text placed after the generation prompt before the model writes (e.g. ``<answer>``); never trained on.
    #: It must be able to begin the asked format (``<think>`` with ``enable_think``, else ``<answer>``): the bandit
    #: preset's ``<answer>`` needs ``agent.response_prefix=<think>`` (or ``''``) beside ``agent.enable_think=true``.
    response_prefix: str = ""
    #: Reward added to a turn whose answer cannot be parsed or names no valid action.
    format_penalty: float = -0.1
    #: The system message of every prompt (a tag's ``system_prompt`` replaces it for that tag).
    system_prompt: str = "You're a helpful assistant."
    #: What separates several actions in one answer (``max_actions_per_turn`` > 1).
    action_sep: str = "||"
    #: Shaped reward per turn for a well-formed answer with a non-empty ``<think>`` (0 = off; needs enable_think).
    think_reward: float = 0.0
    #: Shaped reward per turn whose ``<prediction>`` (inside ``<think>``) equals the env's next
    #: observation exactly (VAGEN's world modelling; 0 = off; when on the prompt asks for it).
    prediction_reward: float = 0.0
    #: What each turn's prompt holds: ``full`` = the whole episode so far, and the episode is one
    #: training sample (RAGEN's default); ``window`` = the env's instructions plus only the last
    #: ``max_context_window`` turns, and every turn is its own training sample (verl-agent style,
    #: for long horizons). See docs/context_modes.md.
    context_mode: str = "full"
    #: Past turns (observation + answer) kept in a ``window`` prompt; 0 = the current observation only.
    max_context_window: int = 2
    #: Replaces the env's own instructions in the first prompt ("" = the env's); an env tag's ``instructions``
    #: sets it for that tag's episodes.
    instructions: str = ""
