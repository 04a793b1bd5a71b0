"""The generic C path (csrc/generic/: plain C11, no intrinsics, built with -ffp-contract=off; SPECFLEET_ISA=generic).

Contract (csrc/q_common.h): generic is the reference the architecture bodies reproduce, and on x86 it gives
the AVX2/VNNI paths' bits everywhere: the integer block sums are exact in every body and grouped in the same
eight lanes, and every fp32 step is the same operation in the same order (fmaf where x86 fuses). So nothing
is left to a separate float64-only contract; the float64 bounds of tests/runtime/backends/native/test_qkernels.py and
tests/runtime/backends/native/test_decode_fused.py hold for it through the bit equality. Formats, fused products, attention and rotary
against every x86 path are tests/runtime/backends/native/test_isa_paths.py's (generic is one of its paths); here: the bf16 linear,
the choice (never by itself), and a real model's forward through the layer loop."""
import pytest
import torch

from specfleet.runtime.backends.native import kernels as native_backend

pytestmark = pytest.mark.skipif(native_backend.missing() is not None or not native_backend.runnable_isas(),
                                reason=f"native kernels: {native_backend.missing()}")


def _generic():
    lib = native_backend.library("generic")
    assert lib is not None, native_backend._reasons.get("generic")
    assert lib.specfleet_q_isa().decode() == "generic"
    return lib


def test_generic_is_pinnable_but_never_chosen_by_itself(monkeypatch):
    assert "generic" not in native_backend.runnable_isas() and native_backend.isa() != "generic"
    monkeypatch.setenv("SPECFLEET_ISA", "generic")
    assert native_backend.isa() == "generic"
    assert all("arch" not in str(p) for p in native_backend.sources("generic"))
    assert not any(f.startswith(("-m", "-march")) for f in native_backend.flags("generic"))


@pytest.mark.parametrize("path", [p for p in native_backend.runnable_isas()])
def test_bf16_linear_gives_the_x86_bits(path):
    gen, fast = _generic(), native_backend.library(path)
    g = torch.Generator().manual_seed(3)
    for m, k, n in ((1, 64, 70), (2, 100, 33), (7, 37, 129), (13, 256, 64)):  # K tails past the last 8
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g).bfloat16()
        outs = [native_backend.run_bf16_linear(lib, x, w, None) for lib in (gen, fast)]
        assert torch.equal(outs[0], outs[1]), (path, m, k, n)


def test_a_real_model_forward_gives_the_x86_bits():
    """SmolLM2's GGUF (Q4_1 and friends) through specfleet_decode_layers: a 9-token prompt, then a 4-row
    verification-like step, the hidden states of the generic library equal the best x86 path's."""
    from tests.conftest import real_model_path
    from specfleet.runtime.backends.native.forward import forward_native
    from specfleet.runtime.kv.cache import KVCache
    from specfleet.runtime.loading.load import load_model
    from specfleet.runtime.model.attention import AttentionBatch, SeqAttention

    model, _ = load_model(str(real_model_path("smollm2-135m-instruct")), torch.float32, torch.device("cpu"),
                          quantization="auto")
    hidden = {}
    for name, lib in (("generic", _generic()), ("best", native_backend.library())):
        kv = KVCache.allocate(model.config, 2, 16, torch.float32, torch.device("cpu"))
        ids = torch.tensor([1, 504, 3458, 282, 253, 1789, 28, 2024, 30])
        a = forward_native(model, lib, ids, torch.arange(9),
                           AttentionBatch(torch.arange(9), [SeqAttention(9, 0, slice(0, 9))]), kv)
        b = forward_native(model, lib, ids[:4], torch.arange(9, 13),
                           AttentionBatch(torch.arange(9, 13), [SeqAttention(4, 9, slice(0, 13))]), kv)
        hidden[name] = (a, b)
    assert torch.equal(hidden["generic"][0], hidden["best"][0]) and torch.equal(hidden["generic"][1], hidden["best"][1])
