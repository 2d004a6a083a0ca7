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

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> "TrainBatch":
        return TrainBatch(**{k: v[index] for k, v in self.__dict__.items()})


def collate(trajectories: list[Trajectory], pad_id: int) -> TrainBatch:
    B = len(trajectories)
    L = max(len(t.input_ids) for t in trajectories)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, L - 1))
    token_rewards = torch.zeros((B, L - 1))
    turn_rewards = torch.zeros((B, L - 1))
    turn_ends = torch.zeros((B, L - 1), dtype=torch.bool)
    for b, traj in enumerate(trajectories):
        n = len(traj.input_ids)
        input_ids[b, :n] = torch.tensor(traj.input_ids)
        attention_mask[b, :n] = 1
        response_mask[b, : n - 1] = torch.tensor(traj.loss_mask[1:], dtype=torch.float)
        for (start, end), turn in zip(traj.turn_spans, traj.turns):
            if end > start:  # an empty reply has no token to carry its reward
                turn_ends[b, end - 2] = True  # target index of the turn's last token
                turn_rewards[b, end - 2] += turn.reward
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
    )
