"""Episode-level metrics over a list of trajectories (shared by training and validation)."""

from __future__ import annotations

import statistics

from ragen.agent.trajectory import Trajectory


def episode_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """success, reward mean/std, format-valid turn rate, actions and response length per episode.

    Episodes whose env raised are counted in ``{prefix}/env_errors`` and left out of the rest.
    """
    ok = [t for t in trajectories if not t.error]
    turns = [turn for t in ok for turn in t.turns]
    rewards = [t.reward for t in ok]
    out = {
        f"{prefix}/episodes": float(len(ok)),
        f"{prefix}/env_errors": float(len(trajectories) - len(ok)),
    }
    if not ok:
        return out
    out.update(
        {
            f"{prefix}/success": sum(t.success for t in ok) / len(ok),
            f"{prefix}/reward_mean": statistics.fmean(rewards),
            f"{prefix}/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            f"{prefix}/format_valid": sum(turn.format_valid for turn in turns) / max(1, len(turns)),
            f"{prefix}/turns_per_episode": len(turns) / len(ok),
            f"{prefix}/actions_per_episode": sum(t.num_actions for t in ok) / len(ok),
            f"{prefix}/response_length": sum(t.response_length for t in ok) / max(1, len(turns)),
        }
    )
    return out
