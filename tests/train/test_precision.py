"""precision=auto picks bf16 only where the hardware multiplies bf16 natively."""

import pytest

from ragen.config import load_config
from ragen.models import precision as prec


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_follows_native_bf16_support(monkeypatch, native, expected):
    monkeypatch.setattr(prec.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: native)
    assert prec.resolve_precision("auto") == expected
    assert prec.resolve_precision("fp32") == "fp32" and prec.resolve_precision("bf16") == "bf16"


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="fp8"):
        prec.resolve_precision("fp8")


def test_resolved_config_records_a_concrete_precision(monkeypatch):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(prec.torch.cuda, "is_available", lambda: False)
    assert load_config("bandit").trainer.precision == "fp32"
    assert load_config("bandit", ["trainer.precision=bf16"]).trainer.precision == "bf16"
