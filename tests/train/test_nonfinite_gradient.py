"""A NaN or infinite gradient norm skips the optimizer step (RL and SFT) instead of writing NaN into every weight."""

import json

import torch

from ragen.cli import main
from ragen.config import load_config
from ragen.models import load_model
from ragen.sft import trainer as sft_trainer
from ragen.train.trainer import StarPOTrainer

from tests.train.trajectories import shared_prompt_trajectories

BASE = ["model=tiny", "trainer.val_episodes=1", "optim.lr=1e-3", "algorithm.mini_batch_size=3", "algorithm.micro_batch_size=2"]


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_nan_gradient_skips_the_rl_step_and_keeps_weights_moments_and_schedule(tmp_path):
    trainer = StarPOTrainer(load_config("bandit", [*BASE, f"trainer.output_dir={tmp_path / 'run'}"]))
    trajectories = shared_prompt_trajectories(trainer.tokenizer)
    torch.manual_seed(0)
    assert trainer.update(trajectories)["actor/nonfinite_grad_skipped"] == 0.0  # a real step: moments non-zero
    weights, epoch = snapshot(trainer.model), trainer.scheduler.last_epoch
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    poisoned = next(p for p in trainer.model.parameters() if p.requires_grad)
    handle = poisoned.register_hook(lambda grad: grad * float("nan"))  # one NaN gradient, as an overflow makes
    torch.manual_seed(1)
    metrics = trainer.update(trajectories)
    handle.remove()
    assert metrics["actor/nonfinite_grad_skipped"] == 1.0 and torch.isnan(torch.tensor(metrics["actor/grad_norm"]))
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, weights[name]), name  # before the fix: NaN everywhere after AdamW
    for p, state in trainer.optimizer.state.items():
        for slot, value in state.items():
            assert torch.equal(value, moments[id(p)][slot]), slot
    assert trainer.scheduler.last_epoch == epoch
    torch.manual_seed(2)
    assert trainer.update(trajectories)["actor/nonfinite_grad_skipped"] == 0.0  # the next clean step trains
    assert any(not torch.equal(p, weights[n]) for n, p in trainer.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_an_infinite_sft_loss_skips_its_step_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"<answer>{i}</answer>"}]}) + "\n"
                            for i in range(8)))
    real, calls = sft_trainer.SFTTrainer.nll_sum, []

    def first_step_overflows(self, batch):
        calls.append(1)
        loss = real(self, batch)
        return loss * float("inf") if len(calls) == 1 else loss  # the first training micro-batch only

    monkeypatch.setattr(sft_trainer.SFTTrainer, "nll_sum", first_step_overflows)
    monkeypatch.setattr(sft_trainer.SFTTrainer, "evaluate", lambda self: {})
    run = tmp_path / "run"
    assert main(["sft", "train", str(data), "model=tiny", "trainer.progress_bar=false", "trainer.batch_size=4",
                 "trainer.micro_batch_size=2", "trainer.max_steps=2", f"trainer.output_dir={run}"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("train/nonfinite_grad_skipped") for line in lines if line["step"] > 0] == [1.0, 0.0]
    assert "step 1: the gradient norm was" in capsys.readouterr().out
    model, _ = load_model(str(run / "final"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
