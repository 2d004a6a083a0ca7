"""optim.trainable_layers: only the top layers move, and their gradients are exactly the full model's."""

import torch
from safetensors.torch import load_file

from ragen.cli import main
from ragen.models import apply_lora, load_model
from ragen.models.freeze import decoder_layers, train_top_layers


def loss_of(model, ids):
    return model(ids, labels=ids).loss


def test_top_layer_gradients_equal_the_full_models():
    full, tokenizer = load_model("tiny", seed=0)
    top, _ = load_model("tiny", seed=0)
    n_layers = len(decoder_layers(top))
    frozen = train_top_layers(top, 1)
    assert frozen and all(not n.startswith(f"model.layers.{n_layers - 1}.") for n in frozen)
    assert "model.embed_tokens.weight" in frozen
    ids = tokenizer("The arms are Gambler and Teacher. <answer>Gambler</answer>", return_tensors="pt")["input_ids"]
    loss_of(full, ids).backward()
    loss_of(top, ids).backward()
    trained = {n: p for n, p in top.named_parameters() if p.requires_grad}
    assert set(trained) == {n for n, _ in top.named_parameters() if n.startswith(f"model.layers.{n_layers - 1}.")} | {"model.norm.weight"}
    full_grads = dict(full.named_parameters())
    for name, p in trained.items():
        torch.testing.assert_close(p.grad, full_grads[name].grad)
    assert all(p.grad is None for n, p in top.named_parameters() if n not in trained)


def test_lora_adapters_only_in_the_top_layers():
    model, _ = load_model("tiny", seed=0)
    model = apply_lora(model, rank=4, alpha=8)
    n_layers = len(decoder_layers(model))
    train_top_layers(model, 1)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and f"layers.{n_layers - 1}." in n for n in names)


def test_zero_or_all_layers_changes_nothing():
    model, _ = load_model("tiny", seed=0)
    assert train_top_layers(model, 0) == [] and train_top_layers(model, len(decoder_layers(model))) == []
    assert all(p.requires_grad for p in model.parameters())


def test_a_run_moves_only_the_top_layer(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "bandit", "model=tiny", "optim.trainable_layers=1", "optim.lr=1e-3", "trainer.total_steps=1",
                 "algorithm.entropy_coeff=0.01",  # a gradient even when every reward ties
                 f"trainer.output_dir={run}", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                 "rollout.temperature=1.0", "trainer.val_episodes=1", "trainer.progress_bar=false", "trainer.plot=false"]) == 0
    before, _ = load_model("tiny", seed=0)
    after = load_file(run / "final" / "model.safetensors")
    n_layers = len(decoder_layers(before))
    state = before.state_dict()
    assert torch.equal(state["model.layers.0.mlp.down_proj.weight"], after["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(state["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    top = f"model.layers.{n_layers - 1}.mlp.down_proj.weight"
    assert not torch.equal(state[top], after[top])


def test_negative_is_a_config_error():
    assert main(["train", "bandit", "model=tiny", "optim.trainable_layers=-1"]) == 2
