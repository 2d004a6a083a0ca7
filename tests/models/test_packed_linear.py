"""Linears on oneDNN- or MKL-packed weights compute ``F.linear``, in fp32 and bf16, packed or not."""

import pytest
import torch
import torch.nn.functional as F

from ragen.models.packed_linear import PackedLinear, mkl_packing_available, packing_available
from ragen.models.precision import cpu_has_native_bf16

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(dtype, pack, bias):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 48, generator=g).to(dtype)
    b = torch.randn(70, generator=g).to(dtype) if bias else None
    linear = PackedLinear(weight, b, pack=pack)
    assert linear.packed == (pack and packing_available(dtype))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for shape in [(1, 48), (5, 48), (64, 48), (200, 48), (3, 4, 48)]:  # decode rows, a prefill, a 3-D batch
        x = torch.randn(*shape, generator=g).to(dtype)
        out = linear(x)
        assert out.shape == (*shape[:-1], 70) and out.dtype == dtype
        torch.testing.assert_close(out, F.linear(x, weight, b), **tol)
    x = torch.randn(48, 6, generator=g).to(dtype).t()  # a transposed view, as the fused step's GEMMs hand on
    torch.testing.assert_close(linear(x), F.linear(x, weight, b), **tol)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_is_available_and_taken_where_torch_has_onednn(dtype):
    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        pytest.skip("no native bf16 on this CPU: oneDNN may refuse bf16 (the fallback then runs)")
    assert packing_available(dtype)  # else the fused decode step silently runs the slower fallback
    assert PackedLinear(torch.ones(4, 8, dtype=dtype)).packed


@needs_onednn
def test_a_packed_weight_is_a_copy():
    weight = torch.randn(6, 8)
    linear = PackedLinear(weight)
    x = torch.randn(2, 8)
    before = linear(x)
    weight.mul_(2)  # an optimizer step on the parameter
    torch.testing.assert_close(linear(x), before)  # the owner must rebuild it (FusedDecoder.clear)


@pytest.mark.parametrize("bias", [True, False])
def test_mkl_packed_linear_equals_f_linear_at_its_rows_and_runs_the_plain_path_at_others(bias):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 48, generator=g)
    b = torch.randn(70, generator=g) if bias else None
    linear = PackedLinear(weight, b, mkl=True)
    assert linear.mkl == mkl_packing_available() and not linear.packed and linear.mkl_rows is None
    linear.pack_rows(5)
    linear.pack_rows(7)  # packed once: the first row count (the decode batch) stays
    assert linear.mkl_rows == (5 if linear.mkl else None)
    for shape in [(5, 48), (1, 48), (64, 48), (200, 48), (3, 5, 48)]:
        x = torch.randn(*shape, generator=g)
        out = linear(x)
        assert out.shape == (*shape[:-1], 70)
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        if shape in [(5, 48), (64, 48)]:  # MKL's GEMM writes row-major output; the plain path's (W @ xᵀ)ᵀ is a transposed view
            assert out.is_contiguous() == (linear.mkl and shape == (5, 48))
    x = torch.randn(48, 5, generator=g).t()  # a transposed view, as the fused step's GEMMs hand on
    torch.testing.assert_close(linear(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert not PackedLinear(weight.bfloat16(), mkl=True).mkl  # MKL's packed GEMM is fp32 only


@pytest.mark.skipif(not (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()),
                    reason="torch built without MKL or oneDNN (its MKL linear ops need both)")
def test_mkl_packing_is_available_where_torch_has_mkl():
    assert mkl_packing_available()  # else the fused fp32 decode step silently runs the plain path
    weight = torch.randn(6, 8)
    linear = PackedLinear(weight, mkl=True)
    linear.pack_rows(2)
    x = torch.randn(2, 8)
    before = linear(x)
    weight.mul_(2)  # an optimizer step on the parameter: the packed copy does not follow it (FusedDecoder.clear)
    torch.testing.assert_close(linear(x), before)
