"""No training step keeps tensors of the steps before it alive: what a long run holds stays flat.

After a warm-up step (AdamW's moments, the fused decode's packed weights and caches are made once), the tensors
Python can reach are counted after every further step; their number and bytes must not grow. A list that collects
each step's log-probs, or trajectories kept by a logger, would show up here as growth in both.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ragen.config import load_config

SMALL = ["model=tiny", "trainer.val_episodes=2", "rollout.env_groups=2", "rollout.group_size=2",
         "rollout.max_new_tokens=8", "trainer.progress_bar=false"]


def live_tensors() -> tuple[int, int]:
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


@pytest.mark.parametrize("preset", ["bandit", "sokoban"])
def test_rl_steps_keep_no_tensors_of_earlier_steps(preset, tmp_path):
    from ragen.train.trainer import StarPOTrainer

    trainer = StarPOTrainer(load_config(preset, [*SMALL, f"trainer.output_dir={tmp_path}"]))
    seen = []
    for step in range(1, 6):
        trainer.update(trainer.rollout(step))
        seen.append(live_tensors())
    counts, sizes = zip(*seen[1:])
    assert max(counts) == min(counts), seen
    assert max(sizes) - min(sizes) <= 64 * 1024, seen  # this step's advantages (a few rows) may differ in length


def test_sft_steps_keep_no_tensors_of_earlier_steps(tmp_path):
    from ragen.sft.config import load_sft_config
    from ragen.sft.generate import write_jsonl
    from ragen.sft.trainer import SFTTrainer

    data = tmp_path / "chats.jsonl"
    write_jsonl([{"messages": [{"role": "user", "content": f"Pick {i}."},
                               {"role": "assistant", "content": "<answer>" + "A " * (i % 7) + "</answer>"}]}
                 for i in range(24)], data)
    trainer = SFTTrainer(load_sft_config(None, [f"data.path={data}", "model=tiny", "trainer.progress_bar=false",
                                                "trainer.batch_size=4", "trainer.micro_batch_size=2",
                                                f"trainer.output_dir={tmp_path / 'run'}"]))
    seen = []
    for start in range(0, 20, 4):
        trainer.optimizer_step(trainer.data.train[start % len(trainer.data.train):][:4])
        seen.append(live_tensors())
    assert len({count for count, _ in seen[1:]}) == 1, seen
    assert len({size for _, size in seen[1:]}) == 1, seen


def test_a_rollout_after_an_update_runs_without_the_update_s_gradients(tmp_path):
    from ragen.train.trainer import StarPOTrainer
    from tests.train.trajectories import shared_prompt_trajectories

    trainer = StarPOTrainer(load_config("bandit", [*SMALL, "optim.lr=1e-3", f"trainer.output_dir={tmp_path}"]))
    torch.manual_seed(0)
    metrics = trainer.update(shared_prompt_trajectories(trainer.tokenizer))  # rewards with spread: a real step
    assert metrics["actor/nonfinite_grad_skipped"] == 0.0 and metrics["actor/grad_norm"] > 0
    assert any(p.grad is not None for p in trainer.model.parameters())  # readable after the update
    seen = []
    real = trainer.train_rollout.run

    def spying(*args, **kwargs):
        seen.append([n for n, p in trainer.model.named_parameters() if p.grad is not None])
        return real(*args, **kwargs)

    trainer.train_rollout.run = spying
    trainer.rollout(2)
    assert seen == [[]], seen
