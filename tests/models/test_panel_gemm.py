"""ragen's fp32 panel GEMM computes ``F.linear`` up to float rounding, and serves only the calls it was measured on."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen.models import native
from ragen.models.packed_linear import PANEL_MAX_ROWS, PackedLinear

GEMM = native.gemm_ops()
needs_gemm = pytest.mark.skipif(GEMM is None, reason=f"panel GEMM unavailable: {native.GEMM.reason}")


def close_to_f_linear(out, x, w, b=None):
    """fp32 sums of K products in another order: within a few K·eps of the products' magnitudes."""
    expected = F.linear(x, w, b)
    scale = (x.abs() @ w.abs().t()) + (b.abs() if b is not None else 0)  # (M, N): the sum of |terms|
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert ((out - expected).abs() <= 4 * x.shape[-1] * 2**-24 * scale + 1e-30).all()


@needs_gemm
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), inner=st.integers(1, 300), out=st.integers(1, 100), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_panels_compute_f_linear(rows, inner, out, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(out, inner, generator=g), torch.randn(rows, inner, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    panels = GEMM.pack_panels(w)
    assert panels.shape == (-(-out // 16), inner, 16)
    assert torch.equal(panels[..., :].transpose(1, 2).reshape(-1, inner)[:out], w)  # panel p holds rows 16p.. of W
    assert not panels.transpose(1, 2).reshape(-1, inner)[out:].any()  # zero past N
    close_to_f_linear(GEMM.linear_panels(x, panels, out, b), x, w, b)


@needs_gemm
def test_panels_take_any_layout_of_x_and_no_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g)
    panels = GEMM.pack_panels(w)
    x = torch.randn(24, 5, generator=g).t()  # a transposed view, as (W @ hᵀ)ᵀ hands on
    close_to_f_linear(GEMM.linear_panels(x, panels, 40, None), x, w)
    assert GEMM.linear_panels(torch.empty(0, 24), panels, 40, None).shape == (0, 40)


@needs_gemm
def test_panels_refuse_what_does_not_match():
    panels = GEMM.pack_panels(torch.randn(40, 24))
    with pytest.raises(RuntimeError, match="out_features"):
        GEMM.linear_panels(torch.randn(2, 24), panels, 60, None)
    with pytest.raises(RuntimeError, match="input size"):
        GEMM.linear_panels(torch.randn(2, 25), panels, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        GEMM.linear_panels(torch.randn(2, 24), panels, 40, torch.randn(39))
    with pytest.raises(RuntimeError, match="fp32"):
        GEMM.pack_panels(torch.randn(40, 24).double())


@needs_gemm
@pytest.mark.parametrize("bias", [True, False])
def test_a_panel_linear_serves_decode_sized_calls_and_larger_ones_take_the_plain_weight(bias, monkeypatch):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 48, generator=g)
    b = torch.randn(70, generator=g) if bias else None
    linear = PackedLinear(weight, b, pack=False, panel=True)
    assert linear.panels is None and not linear.packed  # packed at the first call that uses it
    linear(torch.randn(PANEL_MAX_ROWS + 1, 48))
    assert linear.panels is None
    linear(torch.randn(2, 48))
    assert linear.panels is not None
    calls = []
    real = linear._gemm

    class Counting:
        def linear_panels(self, *args):
            calls.append(args[0].shape[0])
            return real.linear_panels(*args)

    monkeypatch.setattr(linear, "_gemm", Counting())
    for rows in (1, 7, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 48, generator=g)
        close_to_f_linear(linear(x), x, weight, b)
    assert calls == [1, 7, PANEL_MAX_ROWS]  # the larger calls ran the plain weight's path
    before = linear(x[:3])
    weight.mul_(2)  # the panels are a copy, as every packed weight (the owner rebuilds it)
    torch.testing.assert_close(linear(x[:3]), before)


def test_without_the_library_a_panel_linear_is_a_plain_one_and_asks_only_when_a_call_could_use_it(monkeypatch):
    asked = []
    monkeypatch.setattr(native, "gemm_ops", lambda: asked.append(1))  # None: the library is unavailable
    linear = PackedLinear(torch.randn(8, 4), pack=False, panel=True)
    big = torch.randn(PANEL_MAX_ROWS + 1, 4)
    torch.testing.assert_close(linear(big), F.linear(big, linear.weight))
    assert asked == []  # neither building the linear nor a larger call loads (or compiles) the library
    x = torch.randn(3, 4)
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight))
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight))
    assert asked == [1] and linear.panels is None and not linear.panel  # asked once, then the plain path
