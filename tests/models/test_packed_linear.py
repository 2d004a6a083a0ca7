"""Linears on oneDNN-packed weights compute ``F.linear``, in fp32 and bf16, packed or not."""

import pytest
import torch
import torch.nn.functional as F

from ragen.models.packed_linear import PackedLinear, packing_available
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
