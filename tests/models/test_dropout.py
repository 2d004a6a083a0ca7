import pytest
import torch

from ragen.config import load_config
from ragen.models.dropout import disable_dropout
from ragen.models.tiny import load_tiny
from ragen.train import actor_update as update_module
from ragen.train import trainer as trainer_module
from ragen.train.trainer import StarPOTrainer
from tests.train.trajectories import shared_prompt_trajectories


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_dropout = 0.1  # read in training mode, as transformers' Llama attention does
        self.scale = 0.5  # not a dropout: left alone
        self.resid = torch.nn.Dropout(0.2)
        self.off = torch.nn.Dropout(0.0)


def test_disable_dropout_zeroes_modules_and_attention_attributes_and_names_them():
    model = torch.nn.Sequential(Block(), torch.nn.Dropout1d(0.3))
    changed = disable_dropout(model)
    assert changed == ["0.attention_dropout=0.1", "0.resid", "1"]
    assert model[0].attention_dropout == 0.0 and model[0].resid.p == 0.0 and model[1].p == 0.0
    assert model[0].scale == 0.5
    assert disable_dropout(model) == []  # nothing left


def tiny_with_dropout(p: float):
    def load(spec, seed=0):
        model, tokenizer = load_tiny(seed=seed)
        for layer in model.model.layers:  # what from_pretrained gives for a config with attention_dropout > 0
            layer.self_attn.attention_dropout = p
        return model, tokenizer
    return load


@pytest.mark.parametrize("disable", [True, False])
def test_an_update_is_the_same_function_as_the_scoring_only_without_dropout(disable, tmp_path, monkeypatch):
    """With the model's own dropout on, the update's forward (training mode) is another function than the one that
    scores π_old (eval mode), and the gradient depends on the micro-batch size (other masks). ``algorithm.disable_dropout``
    (the default) turns it off: the gradients of micro-batches of 6 and 1 agree to rounding."""
    monkeypatch.setattr(trainer_module, "load_model", tiny_with_dropout(0.3))
    real_clip, grads = update_module.clip_grad_norm_, {}
    for size in (6, 1):
        config = load_config("bandit", [
            "model=tiny", f"trainer.output_dir={tmp_path / str(size)}", "trainer.val_episodes=1", "trainer.precision=fp32",
            f"algorithm.micro_batch_size={size}", f"algorithm.disable_dropout={str(disable).lower()}"])
        torch.manual_seed(0)
        trainer = StarPOTrainer(config)
        assert all(layer.self_attn.attention_dropout == (0.0 if disable else 0.3) for layer in trainer.model.model.layers)

        def record(params, max_norm, trainer=trainer, size=size):
            grads[size] = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]).clone()
            return real_clip(params, max_norm)

        monkeypatch.setattr(update_module, "clip_grad_norm_", record)
        torch.manual_seed(1)
        trainer.update(shared_prompt_trajectories(trainer.tokenizer))
    difference = float((grads[6] - grads[1]).norm() / grads[6].norm())
    assert difference < 1e-4 if disable else difference > 1e-2


def test_dropout_a_model_reads_from_its_config_is_zeroed_for_training_and_kept_in_what_is_saved(tmp_path):
    """transformers' Falcon reads ``config.attention_dropout`` / ``config.hidden_dropout`` at every forward (no module or
    attribute of its own): without zeroing the config, training-mode forwards stay random after :func:`disable_dropout`."""
    from transformers import FalconConfig, FalconForCausalLM

    from ragen.models.dropout import config_as_loaded, disable_config_dropout

    config = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          attention_dropout=0.5, hidden_dropout=0.5, new_decoder_architecture=False)
    torch.manual_seed(0)
    model = FalconForCausalLM(config).train()
    ids = torch.arange(12).view(2, 6)
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout on, read from the config
    disable_dropout(model)
    assert not torch.equal(model(ids).logits, model(ids).logits)  # no module or attribute held it
    old = disable_config_dropout(model)
    assert old == {"config.attention_dropout": 0.5, "config.hidden_dropout": 0.5}
    assert torch.equal(model(ids).logits, model(ids).logits)
    with config_as_loaded(model, old):
        model.save_pretrained(tmp_path)
    assert model.config.attention_dropout == 0.0 and model.config.hidden_dropout == 0.0  # zeroed again
    saved = FalconConfig.from_pretrained(tmp_path)
    assert saved.attention_dropout == 0.5 and saved.hidden_dropout == 0.5


def test_the_trainer_saves_the_config_dropout_it_trained_without(tmp_path, monkeypatch):
    def load(spec, seed=0):
        model, tokenizer = load_tiny(seed=seed)
        model.config.attention_dropout = 0.25  # the tiny Llama copies it into its attention modules at build time only
        return model, tokenizer

    monkeypatch.setattr(trainer_module, "load_model", load)
    config = load_config("bandit", ["model=tiny", f"trainer.output_dir={tmp_path / 'run'}", "trainer.val_episodes=1"])
    trainer = StarPOTrainer(config)
    assert trainer.config_dropout == {"config.attention_dropout": 0.25} and trainer.model.config.attention_dropout == 0.0
    trainer.save(tmp_path / "final")
    import json
    assert json.loads((tmp_path / "final" / "config.json").read_text())["attention_dropout"] == 0.25
