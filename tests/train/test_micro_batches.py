"""Micro-batches hold whole groups, so the update's shared-prompt forward runs each group's prompt once."""

import torch

from ragen.config import load_config
from ragen.train import trainer as trainer_module
from ragen.train.trainer import StarPOTrainer, group_contiguous

from tests.train.test_end_to_end import shared_prompt_trajectories


def test_group_contiguous_keeps_the_rows_and_the_shuffled_group_order():
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    index = torch.tensor([4, 0, 7, 3, 1, 6, 5, 2])  # a shuffled mini-batch: groups 1, 0, 2 first appear in that order
    out = group_contiguous(index, group_ids)
    assert out.tolist() == [4, 3, 5, 0, 1, 2, 7, 6]
    assert sorted(out.tolist()) == sorted(index.tolist())
    assert group_contiguous(index[:3], group_ids).tolist() == [4, 0, 7]  # one row per group: unchanged


def test_each_micro_batch_runs_whole_groups(tmp_path, monkeypatch):
    config = load_config("bandit", ["model=tiny", f"trainer.output_dir={tmp_path}", "trainer.val_episodes=1",
                                    "algorithm.micro_batch_size=3"])
    trainer = StarPOTrainer(config)
    trajs = shared_prompt_trajectories(trainer.tokenizer)  # 2 groups x 3 rows, one prompt per group
    prompts_per_call = []
    real = trainer_module.policy_forward

    def recording(model, input_ids, attention_mask, response_mask, **kw):
        starts = response_mask.argmax(dim=1)  # (B,): first response target = prompt length - 1
        prompts_per_call.append({tuple(row[m.bool()][: int(s) + 1].tolist()) for row, m, s in zip(input_ids, attention_mask, starts)})
        return real(model, input_ids, attention_mask, response_mask, **kw)

    monkeypatch.setattr(trainer_module, "policy_forward", recording)
    torch.manual_seed(0)
    order = torch.randperm(6)
    groups = [trajs[i].group_id for i in order.tolist()]
    assert groups[:3] != [groups[0]] * 3  # the row shuffle this seed draws splits both groups across micro-batches
    torch.manual_seed(0)
    trainer.update(trajs)
    assert len(prompts_per_call) == 2
    assert all(len(p) == 1 for p in prompts_per_call), prompts_per_call  # one distinct prompt per micro-batch
