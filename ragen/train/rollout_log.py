"""The rollout log: a step's episodes with their tokens, loss mask and advantages, one JSON record each.

``ragen view`` renders these files (docs/viewer.md); a record holds what the model saw and what it was trained on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ragen.agent import Trajectory
from ragen.files import atomic_open, strict_dumps


def write_rollout_log(path: Path, step: int, trajectories: list[Trajectory],
                      trained: tuple[list[Trajectory], torch.Tensor] | None, tokenizer, n: int) -> Path:
    """Write up to ``n`` of ``trajectories`` (:func:`logged_sample`) to ``path`` as JSONL, atomically.

    ``trained`` is the update's episodes with their ``(B, T)`` advantages (None when the update trained nothing);
    an episode not among them is logged with ``in_update: false`` and zero advantages.
    """
    rows = {}
    if trained is not None:
        episodes, advantages = trained
        rows = {id(t): advantages[i] for i, t in enumerate(episodes)}
    path.parent.mkdir(exist_ok=True)
    with atomic_open(path) as f:  # a viewer reading the run meanwhile never sees half a step
        for traj in logged_sample(trajectories, n):
            adv = rows.get(id(traj))
            length = len(traj.input_ids)
            record = {
                "step": step,
                **traj.to_json(),
                "in_update": adv is not None,  # False: filtered out, or an env error (its tokens trained nothing)
                "tokens": [tokenizer.decode([i]) for i in traj.input_ids],
                "loss_mask": traj.loss_mask,
                # advantage of token p sits at target p - 1
                "advantages": [0.0] + (adv[: length - 1].tolist() if adv is not None else [0.0] * (length - 1)),
                "turn_spans": [list(span) for span in traj.turn_spans],
            }
            if traj.window_prompts:  # context_mode=window: what each turn really saw (the viewer shows them)
                record["window_prompts"] = [[tokenizer.decode([i]) for i in p] for p in traj.window_prompts]
            f.write(strict_dumps(record) + "\n")
    return path


def logged_sample(trajectories: list[Trajectory], n: int) -> list[Trajectory]:
    """The first ``n`` trajectories to log, whole groups taken from each env tag in turn (a mixed-tag batch lists
    one tag's groups first: a plain slice would log that tag alone)."""
    groups: dict[str, dict[int, list[Trajectory]]] = {}
    for traj in trajectories:
        groups.setdefault(traj.tag or traj.env_name, {}).setdefault(traj.group_id, []).append(traj)
    queues = [list(by_id.values()) for by_id in groups.values()]
    ordered: list[Trajectory] = []
    for turn in range(max((len(q) for q in queues), default=0)):
        for queue in queues:
            if turn < len(queue):
                ordered += queue[turn]
    return ordered[:n]
