"""Trajectories → padded training tensors, in next-token ("target") coordinates.

A sequence of ``L`` ids gives ``T = L - 1`` targets: position ``t`` of every ``(B, T)``
tensor here scores token ``input_ids[:, t + 1]`` from the logits at ``t``.

Rewards sit on trainable targets (``response_mask`` 1), the only ones the estimators read: a turn's reward on
its last one. A turn with none (an empty reply, or every token masked) pays on the previous turn's last
trainable target -- or, with no earlier one, the next turn's -- so ``Σ token_rewards`` is the episode
return, the score outcome estimators (GRPO) use. Only an episode without any trainable target gets no token
reward (nothing could carry it; the trainer leaves such episodes out); ``scores`` still holds its return.
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
    turn_rewards: torch.Tensor  # (B, T) each turn's reward on that turn's last model-written target (see above)
    turn_ends: torch.Tensor  # (B, T) bool, True at each turn's last model-written target
    group_ids: torch.Tensor  # (B,)
    scores: torch.Tensor  # (B,) episode returns
    anchor_ids: torch.Tensor  # (B, T) long, id of the observation each turn answered (GiGPO anchors), -1 elsewhere
    step_returns: torch.Tensor  # (B, T) discounted return from each turn on, on that turn's targets

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> "TrainBatch":
        return TrainBatch(**{k: v[index] for k, v in self.__dict__.items()})

    def to(self, device: torch.device) -> "TrainBatch":
        """Every tensor on ``device`` (the model's); tensors already there are reused, not copied."""
        return TrainBatch(**{k: v.to(device) for k, v in self.__dict__.items()})

    def trim(self) -> "TrainBatch":
        """Drop the padding columns no row of this batch needs."""
        L = int(self.attention_mask.sum(1).max())
        return TrainBatch(**{k: (v if v.dim() == 1 else v[:, : L if v.shape[1] == self.input_ids.shape[1] else L - 1])
                             for k, v in self.__dict__.items()})


def collate(trajectories: list[Trajectory], pad_id: int, step_gamma: float = 1.0) -> TrainBatch:
    """One row per episode; ``step_gamma`` discounts the per-turn returns of ``step_returns`` (GiGPO's γ)."""
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
        returns = discounted_returns([turn.reward for turn in traj.turns], step_gamma)
        ends = turn_end_targets(traj.turn_spans, response_mask[b])
        for k, ((start, end), turn, last) in enumerate(zip(traj.turn_spans, traj.turns, ends)):
            if last is not None:  # a turn without a trainable target is no turn for the estimators
                turn_ends[b, last] = True
                anchor = anchors.setdefault((traj.tag or traj.env_name, seen[k]), len(anchors))
                anchor_ids[b, start - 1 : end - 1] = anchor
                step_returns[b, start - 1 : end - 1] = returns[k]
        carriers = reward_targets(ends)
        for turn, target in zip(traj.turns, carriers):
            if target is not None:
                turn_rewards[b, target] += turn.reward
        if carriers and carriers[-1] is not None:  # the episode's last trainable target
            token_rewards[b, carriers[-1]] = traj.reward
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


@dataclass
class TurnIndex:
    """Where each model-written target sits in two layouts of the same tokens (``context_mode=window``).

    *Episode* layout: :func:`collate` of the trajectories, one row per episode (its whole
    history). *Turn* layout: :func:`collate_turns`, one row per turn (window prompt + that
    turn's reply). Entry ``i`` maps target ``(turn_row[i], turn_pos[i])`` to
    ``(episode_row[i], episode_pos[i])``; every masked target of either layout appears once.
    Advantages are computed in the episode layout (so group statistics count episodes, and
    token-level estimators chain across turns) and read out in the turn layout.
    """

    turn_row: torch.Tensor  # (N,) long
    turn_pos: torch.Tensor  # (N,) long
    episode_row: torch.Tensor  # (N,) long
    episode_pos: torch.Tensor  # (N,) long

    def to_turns(self, episode_values: torch.Tensor, turn_shape: torch.Size) -> torch.Tensor:
        """(B_episodes, T_e) → (B_turns, T_t); zero off the response targets."""
        out = episode_values.new_zeros(turn_shape)
        out[self.turn_row, self.turn_pos] = episode_values[self.episode_row, self.episode_pos]
        return out

    def to_episodes(self, turn_values: torch.Tensor, episode_shape: torch.Size) -> torch.Tensor:
        """(B_turns, T_t) → (B_episodes, T_e); zero off the response targets."""
        out = turn_values.new_zeros(episode_shape)
        out[self.episode_row, self.episode_pos] = turn_values[self.turn_row, self.turn_pos]
        return out


def collate_turns(trajectories: list[Trajectory], pad_id: int) -> tuple[TrainBatch, TurnIndex]:
    """One training row per non-empty turn: ``window_prompts[k]`` + the turn's sampled ids.

    Only the fields the update reads per row are filled (ids, masks, group ids); rewards,
    anchors and returns stay in the episode layout, where advantages are computed.
    """
    rows: list[tuple[list[int], int, int, int]] = []  # (ids, prompt length, episode, episode start)
    for e, traj in enumerate(trajectories):
        if len(traj.window_prompts) < len(traj.turn_spans):
            raise ValueError(f"trajectory {e} has {len(traj.turn_spans)} turns but {len(traj.window_prompts)} window "
                             "prompts: it was not played with agent.context_mode=window")
        for (start, end), prompt in zip(traj.turn_spans, traj.window_prompts):
            if end > start:
                rows.append((prompt + traj.input_ids[start:end], len(prompt), e, start))
    B, L = len(rows), max(len(ids) for ids, *_ in rows)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, L - 1))
    index: list[list[int]] = [[], [], [], []]
    for r, (ids, p, e, start) in enumerate(rows):
        n = len(ids)
        input_ids[r, :n] = torch.tensor(ids)
        attention_mask[r, :n] = 1
        response_mask[r, p - 1 : n - 1] = 1  # target t scores token t + 1
        for i in range(n - p):
            index[0].append(r), index[1].append(p - 1 + i), index[2].append(e), index[3].append(start - 1 + i)
    zeros = torch.zeros((B, L - 1))
    batch = TrainBatch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, token_rewards=zeros,
        turn_rewards=zeros.clone(), turn_ends=zeros.bool(),
        group_ids=torch.tensor([trajectories[e].group_id for _, _, e, _ in rows], dtype=torch.long),
        scores=torch.tensor([trajectories[e].reward for _, _, e, _ in rows], dtype=torch.float),
        anchor_ids=torch.full((B, L - 1), -1, dtype=torch.long), step_returns=zeros.clone(),
    )
    return batch, TurnIndex(*(torch.tensor(x, dtype=torch.long) for x in index))


def turn_end_targets(spans: list[tuple[int, int]], response_mask: torch.Tensor) -> list[int | None]:
    """Each turn's last trainable target, or None if it has none.

    Turn ``(start, end)`` writes tokens ``start..end-1``, scored by targets ``start-1..end-2``; only those with
    ``response_mask`` 1 train, so an empty reply (``end == start``) or a fully masked one has none.
    """
    out: list[int | None] = []
    for start, end in spans:
        trainable = response_mask[max(start - 1, 0) : max(end - 1, 0)].nonzero()
        out.append(max(start - 1, 0) + int(trainable[-1]) if len(trainable) else None)
    return out


def reward_targets(ends: list[int | None]) -> list[int | None]:
    """Where each turn's reward goes: its own last trainable target, else the previous turn's that has one, else
    (leading turns without any) the first one of the episode; None only when no turn has a trainable target.

    Never dropped: outcome estimators score an episode by the sum of its token rewards.
    """
    out, last = [], None
    for end in ends:
        last = end if end is not None else last
        out.append(last)
    first = next((end for end in ends if end is not None), None)
    return [target if target is not None else first for target in out]


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """G_k = Σ_{j≥k} γ^{j-k} r_j for each turn k."""
    out, running = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(rewards))):
        running = rewards[k] + gamma * running
        out[k] = running
    return out
