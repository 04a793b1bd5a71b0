"""Weight-only int8: the layer computes what its dequantized weights say, and speculation stays lossless
against the quantized target (chains, trees, batches), through the LLM API as well as the engine."""
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from specfleet.errors import InvalidRequestError
from specfleet.llm import LLM
from specfleet.runtime.formats.quant import Int8Linear, quantize_model, quantize_rows
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from tiny_engines import LENGTHS, make_engine, repetitive_prompts
from tiny_models import ours_from_hf, perturbed_copy, run_to_completion, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_quantize_rows_error_is_within_half_a_step():
    w = torch.randn(40, 64) * torch.linspace(0.01, 3, 40)[:, None]
    w[3] = 0  # an all-zero row must not divide by zero
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (q.float() * s[:, None] - w).abs()
    assert torch.all(err <= s[:, None] / 2 + 1e-6)
    assert torch.all(q[3] == 0)
    # the largest entry of each nonzero row maps to +-127
    assert torch.all(q.abs().amax(dim=1)[torch.arange(40) != 3] == 127)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False])
def test_int8_linear_matches_its_dequantized_weights(dtype, packed):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, bias=True).to(dtype)
    q = Int8Linear.from_linear(lin)
    q.packed = packed and q.packed
    x = torch.randn(2, 5, 64, dtype=dtype)
    ref = F.linear(x.float(), q.dequantized().float(), q.bias.float())
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(q(x).float(), ref, atol=tol, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    # and it is close to the float layer it came from (int8 error only)
    assert (q(x).float() - lin(x).float()).abs().max() < 0.05 * lin(x).float().abs().max()
    # a reduced head: only the first rows
    assert torch.allclose(q.matmul(x, rows=10).float(), ref[..., :10] - q.bias.float()[:10], atol=tol, rtol=1e-2)


def test_rows_are_independent_of_batching():
    """Verification computes k+1 rows at once, decoding one: the same row must give the same result."""
    torch.manual_seed(1)
    q = Int8Linear.from_linear(torch.nn.Linear(128, 200, bias=False))
    x = torch.randn(7, 128)
    together = q(x)
    alone = torch.cat([q(x[i:i + 1]) for i in range(7)])
    assert torch.equal(together, alone)


@pytest.fixture(scope="module")
def qtarget():
    base = ours_from_hf(tiny_hf_model("qwen2"))
    return base, quantize_model(copy.deepcopy(base), "int8")


def test_quantized_model_is_close_to_the_float_one_and_replaces_every_linear(qtarget):
    base, q = qtarget
    assert q.quantization == "int8" and q.lm_head is None and q.head_q is not None
    assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())
    prompts = repetitive_prompts([12, 20])
    a = run_to_completion(make_engine(base), prompts, SamplingParams(temperature=0, max_tokens=1))
    b = run_to_completion(make_engine(q), prompts, SamplingParams(temperature=0, max_tokens=1))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert quantize_model(q, "int8") is q  # idempotent
    with pytest.raises(InvalidRequestError, match="unknown quantization"):
        quantize_model(q, "int4")


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_speculation_is_lossless_against_the_quantized_target(qtarget, batch, shape):
    base, q = qtarget
    draft = quantize_model(perturbed_copy(base, 0.15), "int8")
    cfg = DraftModelConfig(4, kv_cache_bytes=64 << 10) if shape == "chain" else \
        DraftModelConfig(3, top_children=3, max_nodes=8, kv_cache_bytes=64 << 10)
    prompts = repetitive_prompts(LENGTHS[batch])
    plain = run_to_completion(make_engine(q), prompts, GREEDY)
    engine = make_engine(q, DraftModelProposer(draft, "draft", cfg))
    spec = run_to_completion(engine, prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert 0 < engine.stats.num_accepted < engine.stats.num_drafted
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_llm_quantization_option(qtarget):
    base, q = qtarget
    prompts = repetitive_prompts([9, 15, 6])
    plain = run_to_completion(make_engine(q), prompts, GREEDY)
    llm = LLM.from_model(base, None, "prompt-lookup", dtype="float32", quantization="int8", kv_cache_bytes=1 << 20,
                         block_size=4)
    assert llm.model is not base and base.quantization is None  # the caller's model is left as it was
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    with pytest.raises(InvalidRequestError, match="unknown quantization"):
        LLM.from_model(base, None, None, dtype="float32", quantization="int4")


def test_bf16_cpu_upcast_path_computes_the_same_layer():
    """Large bf16 CPU batches run the linear layers in fp32 (runtime/model/decoder.py): same weights, fp32
    accumulation; below the threshold the plain bf16 path runs. Both agree to bf16 rounding, and a
    bf16 model's greedy output is unchanged on a tiny model."""
    import specfleet.runtime.model.decoder as model_mod
    from specfleet.runtime.backends.bind import bind_linear
    from specfleet.runtime.config import RuntimeConfig

    torch.manual_seed(0)
    lin = model_mod.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(20, 64, dtype=torch.bfloat16)
    exact = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    bind_linear(lin, torch.device("cpu"), dataclasses.replace(RuntimeConfig(), upcast_rows=16))
    lin.requires_grad_(False)
    up = lin(x)
    # the fp32 path, rounded once to bf16: within half a bf16 step of the exact product
    assert ((up.float() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6).all()
    small = lin(x[:4])  # under the threshold: torch's bf16 kernel
    assert torch.allclose(small.float(), exact[:4], atol=0.1, rtol=0.02)
    bind_linear(lin, torch.device("cpu"), dataclasses.replace(RuntimeConfig(), upcast_rows=0))
    assert torch.allclose(lin(x).float(), exact, atol=0.1, rtol=0.02)
