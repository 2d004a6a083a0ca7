"""Trajectories → padded training tensors, in next-token ("target") coordinates.

A sequence of ``L`` ids gives ``T = L - 1`` targets: position ``t`` of every ``(B, T)``
tensor here scores token ``input_ids[:, t + 1]`` from the logits at ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragen.agent.trajectory import Trajectory


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    response_mask: torch.Tensor  # (B, T) float, 1 where the target token was written by the model
    token_rewards: torch.Tensor  # (B, T) episode return on the last model-written target
    turn_rewards: torch.Tensor  # (B, T) each turn's reward on that turn's last model-written target
    turn_ends: torch.Tensor  # (B, T) bool, True at each turn's last model-written target
    group_ids: torch.Tensor  # (B,)
    scores: torch.Tensor  # (B,) episode returns
    anchor_ids: torch.Tensor  # (B, T) long, id of the observation each turn answered (GiGPO anchors), -1 elsewhere
    step_returns: torch.Tensor  # (B, T) discounted return from each turn on, on that turn's targets

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> "TrainBatch":
        return TrainBatch(**{k: v[index] for k, v in self.__dict__.items()})

    def trim(self) -> "TrainBatch":
        """Drop the padding columns no row of this batch needs."""
        L = int(self.attention_mask.sum(1).max())
        return TrainBatch(**{k: (v if v.dim() == 1 else v[:, : L if v.shape[1] == self.input_ids.shape[1] else L - 1])
                             for k, v in self.__dict__.items()})


def collate(trajectories: list[Trajectory], pad_id: int, gamma: float = 1.0) -> TrainBatch:
    B = len(trajectories)
    L = max(len(t.input_ids) for t in trajectories)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, L - 1))
    token_rewards = torch.zeros((B, L - 1))
    turn_rewards = torch.zeros((B, L - 1))
    turn_ends = torch.zeros((B, L - 1), dtype=torch.bool)
    anchor_ids = torch.full((B, L - 1), -1, dtype=torch.long)
    step_returns = torch.zeros((B, L - 1))
    anchors: dict[tuple[str, str], int] = {}  # (env tag, observation text) -> id: states of different tags never share one
    for b, traj in enumerate(trajectories):
        n = len(traj.input_ids)
        input_ids[b, :n] = torch.tensor(traj.input_ids)
        attention_mask[b, :n] = 1
        response_mask[b, : n - 1] = torch.tensor(traj.loss_mask[1:], dtype=torch.float)
        seen = [traj.initial_observation] + [turn.observation for turn in traj.turns]
        returns = discounted_returns([turn.reward for turn in traj.turns], gamma)
        for k, ((start, end), turn) in enumerate(zip(traj.turn_spans, traj.turns)):
            if end > start:  # an empty reply has no token to carry its reward
                turn_ends[b, end - 2] = True  # target index of the turn's last token
                turn_rewards[b, end - 2] += turn.reward
                anchor = anchors.setdefault((traj.tag or traj.env_name, seen[k]), len(anchors))
                anchor_ids[b, start - 1 : end - 1] = anchor
                step_returns[b, start - 1 : end - 1] = returns[k]
        if traj.turn_spans and traj.turn_spans[-1][1] > traj.turn_spans[-1][0]:
            token_rewards[b, traj.turn_spans[-1][1] - 2] = traj.reward
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        token_rewards=token_rewards,
        turn_rewards=turn_rewards,
        turn_ends=turn_ends,
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        scores=torch.tensor([t.reward for t in trajectories], dtype=torch.float),
        anchor_ids=anchor_ids,
        step_returns=step_returns,
    )


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """G_k = Σ_{j≥k} γ^{j-k} r_j for each turn k."""
    out, running = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(rewards))):
        running = rewards[k] + gamma * running
        out[k] = running
    return out
