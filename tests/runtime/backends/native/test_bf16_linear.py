"""The native bf16 kernel (runtime/backends/native/csrc/bf16_linear.c via runtime/backends/native/build.py): exact fp32 sums of the
bf16 products, batch-invariant rows, routing, fallbacks when it cannot be built."""
import shutil

import pytest
import torch
import torch.nn.functional as F

from specfleet.runtime.backends.native import build as native

from specfleet.runtime.backends.native import kernels as native_backend
from specfleet.runtime.backends.cpu import cpu_linear


needs_native = pytest.mark.skipif(native.missing_prerequisite() is not None,
                                  reason=f"cannot build the kernel here: {native.missing_prerequisite()}")


@needs_native
def test_kernel_builds_where_it_can():
    """Where the prerequisites hold, the kernel must build and load (a broken kernel must not hide
    behind the silent fallback)."""
    assert native_backend.available(), native_backend.unavailable_reason()


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 9, 13, 33])
@pytest.mark.parametrize("k,n", [(64, 48), (72, 130), (13, 7), (256, 515)])  # K tails, N tails, N < 64
def test_matches_fp32_product(m, k, n):
    torch.manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(m, k).bfloat16()
    b = torch.randn(n)
    out = native_backend.bf16_linear(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    ref = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)


@needs_native
def test_rows_are_batch_invariant():
    """Each output is summed in the same order whatever the number of rows, so the linear layers give a
    token verified among k+1 bit for bit what they give it decoded alone (attention, torch's, is not
    batch-invariant in bf16, so bf16 speculative outputs may still differ from plain ones at near-ties;
    the lossless guarantee is pinned in fp32)."""
    torch.manual_seed(5)
    w = torch.randn(300, 200).bfloat16()
    x = torch.randn(17, 200).bfloat16()
    full = native_backend.bf16_linear(x, w)
    for i in range(17):
        assert torch.equal(full[i:i + 1], native_backend.bf16_linear(x[i:i + 1], w))
    assert torch.equal(full[3:8], native_backend.bf16_linear(x[3:8], w))


@needs_native
def test_cpu_linear_routes_bf16_rows_to_the_kernel_up_to_native_rows():
    torch.manual_seed(6)
    w = torch.randn(40, 24).bfloat16()
    x = torch.randn(2, 3, 24).bfloat16()  # 6 rows
    routed = cpu_linear(x, w, None, upcast_rows=4, weight_left=True, native_rows=8)
    assert routed.dtype == torch.bfloat16 and routed.shape == (2, 3, 40)
    assert torch.equal(routed, native_backend.bf16_linear(x.reshape(6, 24), w).bfloat16().view(2, 3, 40))
    # above native_rows, or with it 0, the earlier routes (here the sliced upcast, from 4 rows)
    from specfleet.runtime.backends.cpu import sliced_upcast_linear
    above = cpu_linear(x, w, None, upcast_rows=4, weight_left=True, native_rows=5)
    assert torch.equal(above, sliced_upcast_linear(x.reshape(6, 24), w, None).bfloat16().view(2, 3, 40))
    # a non-contiguous weight never reaches the kernel
    wt = torch.randn(24, 40).bfloat16().t()
    assert torch.equal(cpu_linear(x, wt, None, upcast_rows=0, weight_left=True, native_rows=8), F.linear(x, wt))


def test_unavailable_kernel_reports_why_and_routes_fall_back(monkeypatch, tmp_path):
    """A failed build (here: a compiler that does not exist, or the kernel turned off) leaves the
    kernel unavailable with a reason, and cpu_linear keeps torch's routes."""
    cases = {"no compiler": ("CC", str(tmp_path / "no-such-cc"), "no C compiler"),
             "turned off": ("SPECFLEET_NATIVE", "0", "SPECFLEET_NATIVE=0")}
    for case, (var, value, expect) in cases.items():
        monkeypatch.setattr(native_backend, "_libs", {})  # forget the real library until monkeypatch.undo()
        monkeypatch.setattr(native_backend, "_reasons", {})
        monkeypatch.setattr(native_backend, "_default", None)
        monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv(var, value)
        if case == "no compiler":
            monkeypatch.setattr(shutil, "which", lambda name: None)
        assert not native_backend.available(), case
        assert expect in native_backend.unavailable_reason(), native_backend.unavailable_reason()
        w, x = torch.randn(8, 16).bfloat16(), torch.randn(3, 16).bfloat16()
        assert torch.equal(cpu_linear(x, w, None, upcast_rows=0, weight_left=True, native_rows=8), F.linear(x, w))
        with pytest.raises(RuntimeError, match="unavailable"):
            native_backend.bf16_linear(x, w)
        monkeypatch.undo()  # the real kernel state comes back for the next case and the other tests


@needs_native
def test_compiled_library_is_named_by_its_sources_and_headers(monkeypatch, tmp_path):
    """Several sources link into one library whose cached name hashes every source and the headers they
    include, so editing a header rebuilds it (the GGUF kernels share csrc/q_common.h)."""
    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path / "cache"))
    (tmp_path / "k.h").write_text("#define K 3\n")
    (tmp_path / "a.c").write_text('#include "k.h"\nint b(void);\nint a(void) { return K + b(); }\n')
    (tmp_path / "b.c").write_text("int b(void) { return 4; }\n")
    sources, flags = [tmp_path / "a.c", tmp_path / "b.c"], ["-O1", "-fPIC", "-shared"]
    first = native.compile_library(sources, flags, (tmp_path / "k.h",))
    assert first.a() == 7
    (tmp_path / "k.h").write_text("#define K 5\n")
    second = native.compile_library(sources, flags, (tmp_path / "k.h",))
    assert second._name != first._name and second.a() == 9
