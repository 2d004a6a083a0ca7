"""LoRA through peft: adapters are trainable, the base is frozen, and peft's own deprecation noise stays quiet."""

import warnings

import pytest

from ragen.models import apply_lora, load_model
from ragen.models.lora import peft_quietly


def test_apply_lora_trains_only_adapters_and_passes_on_no_peft_deprecation_warning():
    model, _ = load_model("tiny", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = apply_lora(model, rank=2, alpha=4)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_peft_quietly_lets_every_other_warning_through():
    with pytest.warns(FutureWarning, match="something else"), peft_quietly():
        warnings.warn("something else is deprecated", FutureWarning)
    with pytest.warns(UserWarning, match="is_gradient_checkpointing"), peft_quietly():
        warnings.warn("`is_gradient_checkpointing` is deprecated", UserWarning)  # only the FutureWarning is silenced
