"""``ragen/train/batch.py`` (reward placement), ``checkpoint.py`` (step ordering) and ``loggers.py``
(the wandb run-id file). Hand-built trajectories of plain ids: no model, no tokenizer."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from ragen.agent.trajectory import Trajectory, Turn
from ragen.algos.advantages import AdvantageInputs, sequence_scores
from ragen.algos.registry import get_adv_estimator
from ragen.train.batch import collate

# -- batch.py: a reward is never dropped -------------------------------------------------------------------------

PROMPT, OBS = [7, 7, 7], [8, 8]  # ids the model did not write


def _trajectory(replies: list[list[int]], rewards: list[float], group: int = 0) -> Trajectory:
    """An episode of ``len(replies)`` turns; reply ``k`` (possibly empty) earns ``rewards[k]``."""
    traj = Trajectory(env_name="e", group_id=group, seed=0)
    traj.input_ids, traj.loss_mask = list(PROMPT), [0] * len(PROMPT)
    for k, (reply, reward) in enumerate(zip(replies, rewards)):
        if k:
            traj.input_ids += OBS
            traj.loss_mask += [0] * len(OBS)
        start = len(traj.input_ids)
        traj.input_ids += reply
        traj.loss_mask += [1] * len(reply)
        traj.turn_spans.append((start, len(traj.input_ids)))
        traj.turns.append(Turn("r", [], True, reward, 0.0, observation=f"o{k}"))
    return traj


def _end_target(traj: Trajectory, turn: int) -> int:
    """The target index that scores turn ``turn``'s last token."""
    return traj.turn_spans[turn][1] - 2


def test_episode_reward_survives_an_empty_last_turn():
    traj = _trajectory([[1, 2], []], [1.0, -0.1])  # the last reply has no token (e.g. an immediate stop)
    batch = collate([traj], pad_id=0)
    assert batch.token_rewards.sum().item() == pytest.approx(traj.reward)
    assert batch.token_rewards[0, _end_target(traj, 0)].item() == pytest.approx(0.9)  # the last trainable token


def test_turn_rewards_of_empty_turns_land_on_the_previous_turn_end():
    traj = _trajectory([[1, 2], [], [3], []], [1.0, 0.5, 2.0, -0.1])
    batch = collate([traj], pad_id=0)
    assert batch.turn_rewards[0, _end_target(traj, 0)].item() == pytest.approx(1.5)
    assert batch.turn_rewards[0, _end_target(traj, 2)].item() == pytest.approx(1.9)
    assert batch.turn_rewards.sum().item() == pytest.approx(traj.reward)
    assert batch.turn_ends[0].nonzero().flatten().tolist() == [_end_target(traj, 0), _end_target(traj, 2)]


def test_a_leading_empty_turn_pays_on_the_first_trainable_turn():
    traj = _trajectory([[], [4, 5]], [-0.1, 1.0])  # nothing earlier to carry turn 0's reward
    batch = collate([traj], pad_id=0)
    assert batch.turn_rewards[0, _end_target(traj, 1)].item() == pytest.approx(0.9)
    assert batch.token_rewards[0, _end_target(traj, 1)].item() == pytest.approx(0.9)


def test_a_turn_whose_tokens_are_all_masked_pays_on_the_previous_turn_end():
    traj = _trajectory([[1, 2], [3, 4]], [1.0, 2.0])
    start, end = traj.turn_spans[1]
    traj.loss_mask[start:end] = [0] * (end - start)  # its tokens exist but none is trainable
    batch = collate([traj], pad_id=0)
    assert batch.token_rewards[0, _end_target(traj, 0)].item() == pytest.approx(3.0)
    assert batch.turn_rewards[0, _end_target(traj, 0)].item() == pytest.approx(3.0)
    assert (batch.token_rewards * batch.response_mask).sum().item() == pytest.approx(3.0)


def test_a_trajectory_without_trainable_tokens_keeps_only_its_score():
    """Documented: no token to carry it, so no token reward (the trainer leaves such episodes out)."""
    traj = _trajectory([[], []], [1.0, 2.0])
    batch = collate([traj, _trajectory([[1]], [0.0])], pad_id=0)
    assert batch.token_rewards[0].abs().sum().item() == 0 and batch.turn_rewards[0].abs().sum().item() == 0
    assert batch.scores[0].item() == pytest.approx(3.0)


def test_grpo_scores_an_empty_last_turn_like_its_return():
    """Two episodes of one group, both with return 0.9: equal scores, so zero advantages (not ±0.7)."""
    trajs = [_trajectory([[1, 2], []], [1.0, -0.1]), _trajectory([[1, 3], [4]], [1.0, -0.1])]
    batch = collate(trajs, pad_id=0)
    assert sequence_scores(batch.token_rewards).tolist() == pytest.approx([0.9, 0.9])
    out = get_adv_estimator("grpo")(AdvantageInputs(batch.token_rewards, batch.response_mask, batch.group_ids))
    assert out.advantages.abs().max().item() == pytest.approx(0.0, abs=1e-5)


def test_token_level_return_counts_an_empty_last_turn():
    traj = _trajectory([[1, 2], []], [1.0, -0.1])
    batch = collate([traj], pad_id=0)
    out = get_adv_estimator("reinforce_pp")(AdvantageInputs(batch.token_rewards, batch.response_mask, batch.group_ids))
    first = traj.turn_spans[0][0] - 1
    assert out.returns[0, first].item() == pytest.approx(0.9)  # gamma 1: the first token's return is the episode's


# -- checkpoint.py: steps ordered by number, not by name -----------------------------------------------------------

from ragen.train.checkpoint import checkpoint_dir, checkpoint_dirs, latest_checkpoint, save_checkpoint  # noqa: E402


def _save(run_dir, step: int, keep: int = 2):
    """A real (tiny) checkpoint of one parameter at ``step``."""
    param = torch.nn.Parameter(torch.full((2,), float(step)))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return save_checkpoint(run_dir, step, {"w": param}, optimizer, scheduler, np.random.default_rng(0), {}, keep=keep)


def test_checkpoint_dirs_are_newest_first_past_a_million_steps(tmp_path):
    for step in (2, 999_999, 1_000_000, 10_000_000):
        checkpoint_dir(tmp_path, step).mkdir(parents=True)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_10000000", "step_1000000", "step_999999", "step_000002"]


def test_checkpoint_dirs_skip_directories_that_are_not_step_numbers(tmp_path):
    for name in ("step_000001", "step_000001.bak", "step_best"):  # a user's copies: not this run's checkpoints
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_000001"]


def test_latest_checkpoint_is_the_highest_step_past_a_million(tmp_path):
    _save(tmp_path, 999_999)
    _save(tmp_path, 1_000_000)
    path, ckpt = latest_checkpoint(tmp_path)
    assert path.name == "step_1000000" and ckpt["state"]["step"] == 1_000_000


def test_pruning_keeps_the_newest_steps_past_a_million(tmp_path):
    for step in (999_998, 999_999, 1_000_000):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_1000000", "step_999999"]


def test_pruning_leaves_a_later_step_from_before_a_resume(tmp_path):
    """Unchanged rule, numerically: checkpoints after the saved step (left by a resume that fell back) are kept."""
    for step in (1, 2, 1_000_000):
        checkpoint_dir(tmp_path, step).mkdir(parents=True)
    _save(tmp_path, 3, keep=1)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_1000000", "step_000003"]


# -- loggers.py: the wandb run-id file --------------------------------------------------------------------------

from dataclasses import dataclass  # noqa: E402

import ragen.train.loggers as loggers  # noqa: E402


@dataclass
class _Config:  # WandbLogger only needs a dataclass to record as the run's config
    lr: float = 0.1


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module (not installed here) recording ``wandb.init``'s keyword arguments."""
    calls = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(log=None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_run_id_file_is_written_atomically(tmp_path, monkeypatch, fake_wandb):
    written = []
    real = loggers.write_text_atomic
    monkeypatch.setattr(loggers, "write_text_atomic", lambda path, text: written.append(path) or real(path, text))
    loggers.WandbLogger(_Config(), tmp_path)
    id_file = tmp_path / "wandb" / "ragen_run_id"
    assert written == [id_file]  # a kill mid-write leaves no empty or partial id file
    assert id_file.read_text().strip() == fake_wandb[0]["id"]


def test_resumed_wandb_logger_continues_the_same_run(tmp_path, fake_wandb):
    loggers.WandbLogger(_Config(), tmp_path)
    loggers.WandbLogger(_Config(), tmp_path, resume_step=3)
    assert fake_wandb[0]["id"] == fake_wandb[1]["id"] and fake_wandb[1]["resume"] == "allow"


def test_a_blank_wandb_run_id_file_gets_a_new_id(tmp_path, fake_wandb):
    """A file the old non-atomic write left empty (killed between truncate and write) is not an id."""
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "ragen_run_id").write_text("")
    loggers.WandbLogger(_Config(), tmp_path)
    run_id = fake_wandb[0]["id"]
    assert run_id and (tmp_path / "wandb" / "ragen_run_id").read_text().strip() == run_id
