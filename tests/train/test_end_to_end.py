"""A real (tiny-model) training run through the CLI, and the update moving every parameter."""

import json

import torch

from ragen.cli import main
from ragen.config import load_config
from ragen.train.trainer import StarPOTrainer

from tests.train.trajectories import _batch_with_shared_prompts, _trajectory

REQUIRED = ["step", "train/reward_mean", "train/reward_std", "train/success", "train/format_valid",
            "actor/entropy", "actor/grad_norm", "time/step_s"]


def test_ragen_train_bandit_tiny_writes_the_run_dir(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "bandit", "model=tiny", "trainer.total_steps=2", f"trainer.output_dir={out}",
                 "trainer.val_episodes=4", "trainer.progress_bar=false"]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert "val/success" in lines[0] and "val/success" in lines[-1]
    for line in lines[1:]:
        assert all(key in line for key in REQUIRED), set(REQUIRED) - set(line)
    assert (out / "config.yaml").read_text().count("total_steps: 2") == 1
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "tokenizer.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert "val_before" in summary and "val_after" in summary
    # The run dir loads back as a model.
    assert main(["train", "bandit", f"model={out}", "trainer.total_steps=0", f"trainer.output_dir={tmp_path/'again'}",
                 "trainer.val_episodes=2", "trainer.progress_bar=false"]) == 0


def test_a_zero_step_run_without_validation_before_training_validates_once_and_ends_cleanly(tmp_path):
    # It logs no step (no metrics.jsonl), so there are no curves to draw: a note, not a crash.
    assert main(["train", "bandit", "model=tiny", "trainer.total_steps=0", "trainer.val_before_train=false",
                 f"trainer.output_dir={tmp_path}", "trainer.val_episodes=2", "trainer.progress_bar=false"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "val_after" in summary and "val_before" not in summary
    assert summary["plot"] == "not drawn: the run logged no metrics" and not (tmp_path / "curves.png").exists()


def test_sokoban_multi_turn_tiny_run(tmp_path):
    assert main(["train", "sokoban", "model=tiny", "trainer.total_steps=1", f"trainer.output_dir={tmp_path}",
                 "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "agent.max_turn=2",
                 "trainer.val_episodes=2", "trainer.progress_bar=false"]) == 0


def test_update_moves_every_trainable_parameter(tmp_path):
    config = load_config("bandit", ["model=tiny", f"trainer.output_dir={tmp_path}", "optim.lr=1e-3", "trainer.val_episodes=1"])
    trainer = StarPOTrainer(config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trajs = [_trajectory(trainer.tokenizer, 0, "<answer>A</answer>", 1.0), _trajectory(trainer.tokenizer, 0, "<answer>B</answer>", 0.0)]
    metrics = trainer.update(trajs)
    assert metrics["actor/grad_norm"] > 0
    unchanged = [n for n, p in trainer.model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert not unchanged


def test_lora_trains_only_adapters(tmp_path):
    config = load_config("bandit", ["model=tiny", "lora.rank=4", f"trainer.output_dir={tmp_path}", "optim.lr=1e-3", "trainer.val_episodes=1"])
    trainer = StarPOTrainer(config)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.update([_trajectory(trainer.tokenizer, 0, "<answer>A</answer>", 1.0), _trajectory(trainer.tokenizer, 0, "<answer>B</answer>", 0.0)])
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_B" in n or "lora_A" in n for n in changed)


def test_shared_prompt_pass_equals_the_plain_pass(tiny):
    """The optimised update (each group's prompt once, KV cache reused) gives the plain log-probs and gradients."""
    from ragen.models import autocast
    from ragen.train.logprobs import policy_forward

    model, tokenizer = tiny
    batch = _batch_with_shared_prompts(tokenizer)
    prompt_lengths = batch.response_mask.argmax(dim=1) + 1
    for precision, tol in (("fp32", 1e-5), ("bf16", 5e-2)):
        results = []
        for shared in (None, prompt_lengths):
            model.zero_grad()
            with autocast(precision):
                out = policy_forward(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                     with_entropy=True, prompt_lengths=shared)
            (out.logprobs * batch.response_mask).sum().backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            results.append((out.logprobs.detach(), out.entropy.detach(), grads))
        (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
        assert torch.allclose(lp_a, lp_b, atol=tol), (precision, (lp_a - lp_b).abs().max())
        assert torch.allclose(ent_a, ent_b, atol=tol)
        assert (g_a - g_b).norm() / g_a.norm() < tol


def test_a_run_whose_env_always_raises_reports_it_and_ends_cleanly(tmp_path, monkeypatch, capsys):
    """An env that raises is reported, not fatal: each step says how many episodes failed and why, validation says
    so, and with nothing to plot the run still writes its summary."""
    from ragen.envs.bandit import BanditEnv

    def broken_reset(self, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(BanditEnv, "reset", broken_reset)
    assert main(["train", "bandit", "model=tiny", "trainer.total_steps=1", f"trainer.output_dir={tmp_path}",
                 "rollout.env_groups=2", "rollout.group_size=2", "trainer.val_episodes=2", "trainer.progress_bar=false"]) == 0
    out = capsys.readouterr().out
    assert "step 1: 4 of 4 episodes ended with an env error (first: reset raised RuntimeError('boom'))" in out
    assert "validation before training: env_errors=4 of 4 episodes" in out  # 2 episodes x 2 validation tags
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["plot"].startswith("not drawn: plot_runs: none of the plotted metrics found")
