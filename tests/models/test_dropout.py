import pytest
import torch

from ragen.config import load_config
from ragen.models.dropout import disable_dropout
from ragen.models.tiny import load_tiny
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
    real_clip, grads = trainer_module.clip_grad_norm_, {}
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

        monkeypatch.setattr(trainer_module, "clip_grad_norm_", record)
        torch.manual_seed(1)
        trainer.update(shared_prompt_trajectories(trainer.tokenizer))
    difference = float((grads[6] - grads[1]).norm() / grads[6].norm())
    assert difference < 1e-4 if disable else difference > 1e-2
