"""benchmarks/drafts/agreement.py simulates weight formats that have no kernels yet; at 4 bits its rounding must be
the real quantizers' (gguf's Q4_0 and Q4_1), or its agreement figures say nothing about the formats it names."""
import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "drafts" / "agreement.py"


def _script():
    spec = importlib.util.spec_from_file_location("agreement", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("symmetric, qtype", [(True, "Q4_0"), (False, "Q4_1")])
def test_four_bit_simulation_is_the_real_quantizer(symmetric, qtype):
    from gguf import GGMLQuantizationType as T

    from specfleet.runtime.formats.qtensor import quantize

    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.rand(64, 1) * 3
    w[0, :32] = 0.0  # a block of zeros: no scale to divide by
    w[1, 32:64] = torch.linspace(-1, 1, 32)  # extremes of both signs
    real = quantize(w, getattr(T, qtype)).dequantize(torch.float32)
    sim = _script().fake_quantize(w, 4, symmetric)
    assert torch.equal(sim, real)
    # the check can fail: the other 4-bit format rounds differently
    assert not torch.equal(_script().fake_quantize(w, 4, not symmetric), real)


def test_fewer_bits_lose_more():
    fq = _script().fake_quantize
    w = torch.randn(32, 128)
    errors = [(fq(w, b, False) - w).abs().mean().item() for b in (4, 3, 2)]
    assert errors[0] < errors[1] < errors[2]
    with pytest.raises(ValueError, match="32-weight blocks"):
        fq(torch.randn(4, 40), 4, True)
