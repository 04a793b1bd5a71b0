"""The CPU linear routes (runtime/backends/cpu.py): same products as F.linear, only reordered sums."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from specfleet.runtime.backends.cpu import cpu_linear, sliced_upcast_linear, weight_left_linear


@pytest.mark.parametrize("rows", [2, 3, 5, 16, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_left_product_matches_f_linear(rows, with_bias):
    torch.manual_seed(rows)
    w, x = torch.randn(48, 64), torch.randn(rows, 64)
    b = torch.randn(48) if with_bias else None
    out = weight_left_linear(x, w, b)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slice_bytes", [1, 16 * 64 * 4 * 2, 1 << 30])  # 16-row slices, 32-row slices, one slice
def test_sliced_upcast_covers_every_row_of_the_weight(slice_bytes):
    """Slices of 16/32 rows over 100 output rows leave a partial last slice; all must be computed."""
    torch.manual_seed(1)
    w = torch.randn(100, 64).bfloat16()
    x = torch.randn(9, 64).bfloat16()
    b = torch.randn(100).bfloat16()
    out = sliced_upcast_linear(x, w, b, slice_bytes=slice_bytes)
    assert out.dtype == torch.float32 and out.shape == (9, 100) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x.float(), w.float(), b.float()), atol=1e-4, rtol=1e-5)


def test_routing_by_dtype_and_rows():
    torch.manual_seed(2)
    w32, b32 = torch.randn(40, 24), torch.randn(40)
    w16 = w32.bfloat16()
    x32 = torch.randn(2, 5, 24)  # 3-D input, 10 rows
    x16 = x32.bfloat16()
    # bf16 below the threshold and with routing off: exactly torch's kernel
    assert torch.equal(cpu_linear(x16[:, :1], w16, None, upcast_rows=8, weight_left=True), F.linear(x16[:, :1], w16))
    assert torch.equal(cpu_linear(x16, w16, None, upcast_rows=0, weight_left=True), F.linear(x16, w16))
    assert torch.equal(cpu_linear(x32, w32, b32, upcast_rows=8, weight_left=False), F.linear(x32, w32, b32))
    assert torch.equal(cpu_linear(x32[:1, :1], w32, b32, upcast_rows=8, weight_left=True), F.linear(x32[:1, :1], w32, b32))
    # bf16 at the threshold: fp32 product over the same numbers, rounded once
    up = cpu_linear(x16, w16, None, upcast_rows=8, weight_left=True)
    exact = F.linear(x16.float(), w16.float())
    assert up.dtype == torch.bfloat16 and up.shape == (2, 5, 40)
    assert ((up.float() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6).all()
    # fp32 with 2+ rows: the weight-left product
    torch.testing.assert_close(cpu_linear(x32, w32, b32, upcast_rows=8, weight_left=True), F.linear(x32, w32, b32),
                               atol=1e-5, rtol=1e-5)


def test_model_linear_takes_the_routes(monkeypatch):
    """Turning the routes off changes nothing but rounding. (Which route ran is counted, not read off the bits:
    on an Intel Xeon with AVX512-VNNI the weight-left product happened to round exactly as F.linear.)"""
    from specfleet.runtime.backends import cpu as cpu_backend
    from specfleet.runtime.backends.bind import bind_linear
    from specfleet.runtime.config import RuntimeConfig
    from specfleet.runtime.model.decoder import Linear

    calls = []
    real = cpu_backend.weight_left_linear
    monkeypatch.setattr(cpu_backend, "weight_left_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    torch.manual_seed(3)
    lin = Linear(32, 16)
    x = torch.randn(6, 32)
    cpu, rt = torch.device("cpu"), RuntimeConfig()
    with torch.no_grad():
        on = bind_linear(lin, cpu, rt)(x)
        assert calls == [(6, 32)]  # the weight-left route was taken
        off = bind_linear(lin, cpu, dataclasses.replace(rt, weight_left=False))(x)
        assert calls == [(6, 32)]
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)
    assert torch.equal(off, F.linear(x, lin.weight, lin.bias))
    # training (gradients recorded) takes F.linear and gets its gradients
    bind_linear(lin, cpu, rt)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, x.sum(0).expand(16, 32))
