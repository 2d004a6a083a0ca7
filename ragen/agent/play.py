"""``ragen play ENV [key=value ...]``: play any env in the terminal, seeing what the model sees.

Every message printed between the ``--- user ---`` rules is the exact user-message text
the rollout sends to the model (built by :class:`ragen.agent.context.PromptFormat`), and
answers go through the same path as the model's: the answer text is split on the action
separator and each piece goes through ``env.parse_action``; an answer naming an unknown
action costs the format penalty and leaves the state unchanged.

If a preset named like the env exists (``ragen/configs/<env>.yaml``), its env config and
agent settings (turn limit, actions per turn, think/no-think) are used, so
``ragen play sokoban`` is the training setup. ``key=value`` overrides set env config keys;
``agent.KEY=value`` sets agent settings (``agent.max_turn=20``). Values are read as YAML
(``dim_room=[8,8]``, ``is_slippery=false``, ``high_prob=0.5``).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import fields
from typing import Any, Callable

import yaml

import ragen.envs
from ragen.envs.contract import checked_reset, instructions_problem
from ragen.agent.answer_turn import answer_turn
from ragen.agent.context import PromptFormat
from ragen.agent import AgentConfig

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAG = re.compile(r"<think>.*?</think>|</?answer>", re.DOTALL)
QUIT_WORDS = ("quit", "exit", ":q")
RULE = "--- user (what the model sees) ---"
#: Turn limit when neither a preset nor ``agent.max_turn`` sets one (training's default is 1 turn).
DEFAULT_MAX_TURN = 1000


def parse_value(text: str) -> Any:
    """A ``key=value`` value as YAML (ints, floats, bools, lists); plain text if YAML fails."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_overrides(items: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``key=value`` items into (env config, agent settings); ``ValueError`` naming a bad one."""
    env_cfg: dict[str, Any] = {}
    agent: dict[str, Any] = {}
    known = {f.name for f in fields(AgentConfig)}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value")
        if key.startswith("env.config."):
            key = key[len("env.config.") :]
        if key.startswith("agent."):
            name = key[len("agent.") :]
            if name not in known:
                raise ValueError(f"unknown agent setting {key!r}; known: {', '.join(sorted(known))}")
            agent[name] = parse_value(value)
        else:
            env_cfg[key] = parse_value(value)
    return env_cfg, agent


def preset_settings(env_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Env config and agent settings of the preset named ``env_name``, if there is one."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / f"{env_name}.yaml"
    if not path.is_file():
        return {}, {}
    data = yaml.safe_load(path.read_text()) or {}
    if (data.get("env") or {}).get("name", env_name) != env_name:
        return {}, {}
    return dict((data.get("env") or {}).get("config") or {}), dict(data.get("agent") or {})


def typed_settings(agent: dict[str, Any]) -> AgentConfig:
    """``AgentConfig`` from ``agent``, each value checked against its field's type (``"3"`` becomes 3);
    ``ValueError`` naming the ``agent.KEY`` whose value does not fit."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AgentConfig), agent))
    except OmegaConfBaseException as exc:
        raise ValueError(f"agent.{exc.key}: {str(exc).splitlines()[0]}") from None


def split_answer(text: str, action_sep: str) -> list[str]:
    """Action strings of a typed answer: the ``<answer>`` block's content if present, else the whole line."""
    found = _ANSWER.findall(text)
    body = found[-1] if found else _TAG.sub("", text)
    return [part.strip() for part in (body.split(action_sep) if action_sep else [body]) if part.strip()]


def play(
    env_name: str,
    cfg: dict[str, Any] | None = None,
    seed: int | None = None,
    input_fn: Callable[[str], str] = input,
    print_fn: Callable[..., None] = print,
    agent: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Play one episode of ``env_name`` interactively; return ``success``, ``reward``, ``turns``, ``quit``.

    ``input_fn(prompt)`` returns one answer line (``EOFError`` or ``quit`` ends the game);
    ``print_fn`` shows text. ``agent`` holds :class:`AgentConfig` overrides (without
    ``max_turn``, the game runs until the env ends it, at most ``DEFAULT_MAX_TURN`` turns). Raises
    ``ValueError`` for an unknown env or a bad config (before anything is printed).
    """
    agent = dict(agent or {})
    agent.setdefault("max_turn", DEFAULT_MAX_TURN)  # a person plays until the env ends the episode
    settings = typed_settings(agent)
    if settings.max_turn < 1 or settings.max_actions_per_turn < 1:
        raise ValueError("agent.max_turn and agent.max_actions_per_turn must be >= 1")
    env = ragen.envs.make(env_name, **(cfg or {}))
    raw = env.unwrapped
    fmt = PromptFormat(settings.enable_think, settings.max_actions_per_turn, settings.action_sep)
    observation, _ = checked_reset(env, env.reset(seed=seed))
    instructions = settings.instructions or getattr(raw, "instructions", None)  # as the rollout takes them
    problem = instructions_problem(env, instructions)
    if problem:
        raise ValueError(problem)
    limit = settings.max_actions_per_traj
    actions_left = limit if limit > 0 else None
    if settings.system_prompt:
        print_fn(f"(system prompt: {settings.system_prompt})")
    if settings.response_prefix:
        print_fn(f"(the model's reply is prefilled with {settings.response_prefix!r}; bare action names work too)")
    print_fn(RULE)
    print_fn(fmt.first_user_message(instructions, observation, 1, actions_left))
    total, success, turns, done = 0.0, False, 0, False
    while not done:
        try:
            line = input_fn("> ")
        except (EOFError, KeyboardInterrupt):
            print_fn("")
            return {"success": success, "reward": total, "turns": turns, "quit": True}
        if line.strip().lower() in QUIT_WORDS:
            return {"success": success, "reward": total, "turns": turns, "quit": True}
        if not line.strip():
            continue
        turns += 1
        actions = split_answer(line, settings.action_sep)[: settings.max_actions_per_turn]
        turn_ = answer_turn(env, actions, observation, success, actions_left, settings.format_penalty)
        observation, reward, success, done = turn_.observation, turn_.reward, turn_.success, turn_.done
        actions_left, feedback = turn_.actions_left, turn_.feedback
        total += reward
        if actions_left is not None and actions_left <= 0:
            done = True
        if turns >= settings.max_turn:
            done = True
        if done:
            print_fn(f"Reward: {reward:g}\n{observation}" if not feedback else f"{feedback}\nReward: {reward:g}")
            print_fn(f"Episode over after {turns} turn(s): success={success}, total reward={total:g}")
            break
        print_fn(RULE)
        print_fn(fmt.next_user_message(reward, observation, turns + 1, actions_left, feedback))
    return {"success": success, "reward": total, "turns": turns, "quit": False}


def main_play(env_name: str, overrides: list[str], seed: int | None, input_fn=input, print_fn=print) -> dict[str, Any]:
    """The CLI's entry: preset settings, then overrides; ``ValueError`` for any user mistake."""
    if input_fn is input:
        try:  # line editing and history for people at a terminal
            importlib.import_module("readline")
        except ImportError:
            pass
    if env_name not in ragen.envs.registered():
        raise ValueError(f"unknown env {env_name!r}; registered envs: {', '.join(sorted(ragen.envs.registered()))}")
    env_cfg, agent = preset_settings(env_name)
    user_env, user_agent = parse_overrides(overrides)
    env_cfg.update(user_env)
    agent.update(user_agent)
    try:
        return play(env_name, env_cfg, seed=seed, input_fn=input_fn, print_fn=print_fn, agent=agent)
    except TypeError as exc:  # e.g. a wrong type inside AgentConfig / an env constructor
        raise ValueError(str(exc)) from None
