"""An agent of :mod:`ragen.envs.agents` (the expert, a random player) in the model's seat: one episode as the exact
chat the rollout would have built, for SFT data (``ragen sft generate``)."""

from __future__ import annotations

from typing import Any, Callable

from ragen.agent.answer_turn import answer_turn
from ragen.agent.context import PromptFormat
from ragen.agent.settings import AgentConfig
from ragen.envs.agents import Agent, Budget, begin_episode
from ragen.envs.contract import checked_reset


def record_conversation(
    env: Any,
    agent: Agent,
    seed: int | None = None,
    settings: Any = None,
    think: str | Callable[[Any, list[str]], str] = "",
) -> dict[str, Any]:
    """One episode as the chat the rollout would build, with ``agent`` in the model's seat (SFT data).

    ``messages`` holds the system prompt, every user message exactly as
    :class:`ragen.agent.context.PromptFormat` words it for ``settings``
    (:class:`ragen.agent.rollout.AgentConfig`; defaults if None), and the agent's replies
    as ``<think>{think}</think><answer>a1 || a2</answer>`` (``<answer>…</answer>`` without
    think). ``think`` may also be a callable ``think(env, actions) -> str``, called each turn
    before the actions are stepped (a rationale per turn). Turn limits, actions per turn and
    per episode follow ``settings``, and the agent gets them as its :class:`Budget`.
    Returns ``messages``, ``success``, ``reward`` (env rewards plus format penalties).
    """
    settings = settings or AgentConfig()
    fmt = PromptFormat(settings.enable_think, settings.max_actions_per_turn, settings.action_sep)
    raw = env.unwrapped
    observation, _ = checked_reset(env, env.reset(seed=seed))
    begin_episode(agent, env, seed, Budget.from_settings(settings))
    limit = settings.max_actions_per_traj
    actions_left = limit if limit > 0 else None
    messages = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
    instructions = getattr(settings, "instructions", "") or raw.instructions  # an env tag may reword them
    messages.append({"role": "user", "content": fmt.first_user_message(instructions, observation, 1, actions_left)})
    total, success = 0.0, False
    for turn in range(1, settings.max_turn + 1):
        actions = list(agent.act(env))[: settings.max_actions_per_turn]
        answer = f" {settings.action_sep} ".join(actions)
        rationale = think(env, actions) if callable(think) else think
        reply = f"<think>{rationale}</think><answer>{answer}</answer>" if settings.enable_think else f"<answer>{answer}</answer>"
        messages.append({"role": "assistant", "content": reply})
        turn_ = answer_turn(env, actions, observation, success, actions_left, settings.format_penalty)
        observation, reward, success, done = turn_.observation, turn_.reward, turn_.success, turn_.done
        actions_left, feedback = turn_.actions_left, turn_.feedback
        total += reward
        if done or (actions_left is not None and actions_left <= 0) or turn == settings.max_turn:
            break
        next_user = fmt.next_user_message(reward, observation, turn + 1, actions_left, feedback)
        messages.append({"role": "user", "content": next_user})
    return {"messages": messages, "success": success, "reward": total}

