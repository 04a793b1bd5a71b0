"""The fused decode path of native GGUF models (csrc/q_fused.c, runtime/backends/native/forward.py):
each native call against a float64 reference, at every tail, and row for row the same whatever the
number of rows in the call; the whole model against its module-by-module forward; and speculation
still lossless through it (verification rows attend in C exactly as their decode steps do)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from specfleet.runtime.backends.native import kernels as native_backend

from specfleet.runtime.formats import qtensor

pytestmark = pytest.mark.skipif(not native_backend.available(), reason=f"native kernels: {native_backend.unavailable_reason()}")

from specfleet.runtime.model import decoder as model_mod  # noqa: E402
from specfleet.runtime.model.attention import AttentionBatch, SeqAttention, _attend  # noqa: E402
from specfleet.runtime.step.plan import KeyPlan, native_attend  # noqa: E402
from specfleet.runtime.backends.native.forward import native_lib  # noqa: E402
from specfleet.runtime.formats.qlinear import QLinear  # noqa: E402
from specfleet.runtime.backends.native.kernels import PRE_NONE, PRE_RMSNORM, PRE_SILU_MUL  # noqa: E402
from specfleet.runtime.formats.qtensor import quantize_activations  # noqa: E402
from tests.runtime.backends.native.test_qkernels import dense64, random_blocks  # noqa: E402
from tiny_models import tree_mask  # noqa: E402


def lib():
    return native_backend.library()


def reference(x, parts, pre, norm_w, eps):
    """float64: pre(x) (in float64), rounded through each part's activation int8 blocks, times the parts."""
    k = parts[0][0].shape[1]
    x64 = x.double()
    if pre == PRE_RMSNORM:
        a = norm_w.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))
    elif pre == PRE_SILU_MUL:
        a = F.silu(x64[:, :k]) * x64[:, k:]
    else:
        a = x64
    outs = []
    for w, b in parts:
        y = quantize_activations(a.float(), w.qtype).double() @ dense64(w).t()
        outs.append(y + (b.double() if b is not None else 0))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("pre", [PRE_NONE, PRE_RMSNORM, PRE_SILU_MUL], ids=["none", "rmsnorm", "silu_mul"])
@pytest.mark.parametrize("formats,k", [((T.Q4_K, T.Q6_K), 512), ((T.Q8_0, T.Q4_0, T.Q4_K), 256),
                                       ((T.Q5_0, T.Q4_1), 96)], ids=["k", "mixed", "legacy"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["set", "add"])
def test_fused_linear_matches_float64_and_is_row_invariant(pre, formats, k, accumulate):
    g = torch.Generator().manual_seed(int(pre) * 7 + len(formats))
    widths = [37, 16, 5][:len(formats)]  # chunk tails: not multiples of the 16-row chunk
    parts = [(random_blocks(q, n, k, seed=i), torch.randn(n, generator=g) if i != 1 else None)
             for i, (q, n) in enumerate(zip(formats, widths))]
    lin = QLinear([w for w, _ in parts])
    lin.parts = parts  # biases per part, one left out
    lin._cparts = None
    width = sum(widths)
    norm_w = torch.rand(k, generator=g) + 0.5
    eps = 1e-5
    rows = 70  # past the 64-row sweep and the 32-row parallel quantization
    x = torch.randn(rows, 2 * k if pre == PRE_SILU_MUL else k, generator=g) * 2
    base = torch.randn(rows, width, generator=g)
    y = base.clone()
    lin.fused(lib(), x, y, pre, norm_w if pre == PRE_RMSNORM else None, eps, accumulate)
    ref = reference(x, parts, pre, norm_w, eps) + (base.double() if accumulate else 0)
    scale = ref.abs().max().item()
    # the activations' int8 rounding may flip at a tie between the float64 and fp32 transforms: rare,
    # one quantum of one activation; the bulk must agree to fp32 rounding
    close = ((y.double() - ref).abs() <= 1e-4 * scale).float().mean().item()
    assert close > 0.99
    assert (y.double() - ref).abs().max().item() < 2e-2 * scale
    for m in (1, 2, 9, 33):  # each row as in the 70-row call, alone or with others
        ys = base[:m].clone()
        lin.fused(lib(), x[:m].contiguous(), ys, pre, norm_w if pre == PRE_RMSNORM else None, eps, accumulate)
        assert torch.equal(ys, y[:m])
    one = base[40:41].clone()
    lin.fused(lib(), x[40:41].contiguous(), one, pre, norm_w if pre == PRE_RMSNORM else None, eps, accumulate)
    assert torch.equal(one, y[40:41])


def test_qlinear_forward_through_the_fused_call_equals_the_per_part_products():
    parts = [random_blocks(T.Q4_K, 40, 512, seed=1), random_blocks(T.Q6_K, 24, 512, seed=2)]
    bias = torch.randn(64)
    lin = QLinear(parts, bias)
    x = torch.randn(5, 512)
    per_part = torch.cat([qtensor.qlinear(x, w, b) for w, b in lin.parts], dim=1)
    assert torch.equal(lin(x), per_part)


@pytest.mark.parametrize("d", [64, 128, 12])
def test_rope_kv_equals_torch_rotary_and_writes_the_cache(d):
    heads, kv_heads, t = 6, 2, 5
    rot = model_mod.Rotary(d, 10000.0, 64)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    pos = torch.tensor([3, 7, 8, 20, 63])
    slots = torch.tensor([9, 0, 4, 5, 11])
    q = torch.empty(t, heads, d)
    kc, vc = torch.zeros(12, kv_heads, d), torch.zeros(12, kv_heads, d)
    lib().specfleet_rope_kv(qkv.data_ptr(), t, qkv.stride(0), heads, kv_heads, d, pos.data_ptr(), rot.cos.data_ptr(),
                            rot.sin.data_ptr(), q.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr())
    qr, kr, vr = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    assert torch.equal(q, rot(qr.reshape(t, heads, d), pos))
    assert torch.equal(kc[slots], rot(kr.reshape(t, kv_heads, d), pos))
    assert torch.equal(vc[slots], vr.reshape(t, kv_heads, d))


def attend64(q, k, v, scale):
    """float64 attention of q [H, D] over k, v [L, KVH, D]."""
    h, kvh = q.shape[0], k.shape[1]
    kk = k.double().repeat_interleave(h // kvh, dim=1).transpose(0, 1)  # [H, L, D]
    vv = v.double().repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    p = torch.softmax((kk @ q.double().unsqueeze(-1)).squeeze(-1) * scale, dim=-1)
    return (p.unsqueeze(1) @ vv).squeeze(1)


def _one_batch(*seqs: SeqAttention) -> AttentionBatch:
    return AttentionBatch(torch.zeros(sum(s.query_len for s in seqs), dtype=torch.long), list(seqs))


@pytest.mark.parametrize("length", [1, 7, 8, 9, 70, 300])
@pytest.mark.parametrize("heads,kv_heads,d", [(12, 2, 128), (4, 4, 32), (14, 2, 64)])
def test_native_attention_matches_float64(length, heads, kv_heads, d):
    g = torch.Generator().manual_seed(length)
    k = torch.randn(length + 3, kv_heads, d, generator=g)
    v = torch.randn(length + 3, kv_heads, d, generator=g)
    q = torch.randn(2, heads, d, generator=g) * 3
    # two requests over the same cache rows: a decode row after length - 1 keys, and a 1-row step after length + 2
    batch = _one_batch(SeqAttention(1, length - 1, slice(0, length)), SeqAttention(1, length + 2, slice(0, length + 3)))
    out = native_attend(lib(), q, k, v, batch, d ** -0.5)
    for i, n in enumerate([length, length + 3]):
        ref = attend64(q[i], k[:n], v[:n], d ** -0.5)
        torch.testing.assert_close(out[i].double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("length", [40, 64, 300])
def test_native_attention_bits_do_not_depend_on_the_thread_count(length):
    """Attention forks threads from about 43 keys of the 1.5B's shape: each (row, KV head) is one thread's whole
    work, so one thread and two give the same bits (the control: a changed key changes them)."""
    g = torch.Generator().manual_seed(length)
    k, v = torch.randn(length + 3, 2, 128, generator=g), torch.randn(length + 3, 2, 128, generator=g)
    q = torch.randn(2, 12, 128, generator=g)
    batch = _one_batch(SeqAttention(1, length - 1, slice(0, length)), SeqAttention(1, length + 2, slice(0, length + 3)))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            outs.append(native_attend(lib(), q, k, v, batch, 128 ** -0.5))
        k[length // 2, 1] += 1e-3
        changed = native_attend(lib(), q, k, v, batch, 128 ** -0.5)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert not torch.equal(changed[:, 6:], outs[0][:, 6:]) and torch.equal(changed[:, :6], outs[0][:, :6])


def test_key_plan_lists_each_rows_keys():
    """The module docstring's worked example, a hidden context and a fragmented block table."""
    tree = SeqAttention(3, 3, slice(10, 16), tree_mask([-1, 0, 0]))
    plan = KeyPlan.build(_one_batch(tree))
    assert plan.slots.tolist() == list(range(10, 16))
    assert plan.plen.tolist() == [4, 5, 4] and plan.nkeys.tolist() == [4, 5, 5]
    assert plan.extras[plan.xoff[2]:plan.xoff[2] + 1].tolist() == [5]
    hidden = SeqAttention(2, 3, torch.tensor([40, 41, 7, 8, 9]), None, torch.tensor([[True, False, True]] * 2))
    plan = KeyPlan.build(_one_batch(hidden))
    assert plan.slots.tolist() == [40, 41, 7, 8, 9]
    assert plan.plen.tolist() == [1, 1] and plan.nkeys.tolist() == [3, 4]
    assert plan.extras[:5].tolist() == [2, 3, 2, 3, 4]


@pytest.mark.parametrize("c", [45, 150])
def test_native_verification_rows_equal_their_decode_steps(c):
    """Prompt, chain and tree rows through the key plan: bit for bit the decode step's output (a one-row
    call over the row's own keys copied elsewhere in the cache, in order), and close to float64. With 150 keys of
    context, rows of a group also share whole 64-key chunks of values (the 512-bit path takes them two rows at a
    time, as it takes their scores)."""
    g = torch.Generator().manual_seed(3)
    h, kvh, d = 12, 2, 128
    # a chain of 19 rows: attention takes a request's prefix rows 8 at a time (groups of 8, 8, 3 sharing key
    # loads); then a tree, whose rows with gathered keys go one at a time
    parents = [-1, 0, 0, 1, 2, 4] + [-1] * 13
    n = len(parents)
    cache_k = torch.randn(2 * c + 120, kvh, d, generator=g)
    cache_v = torch.randn(2 * c + 120, kvh, d, generator=g)
    q = torch.randn(n, h, d, generator=g)
    for new_mask in (None, tree_mask(parents[:6])):
        n = 6 if new_mask is not None else len(parents)
        out = native_attend(lib(), q[:n].contiguous(), cache_k, cache_v,
                            _one_batch(SeqAttention(n, c, slice(10, 10 + c + n), new_mask)), d ** -0.5)
        for i in range(n):
            seen = (torch.arange(i + 1) if new_mask is None else new_mask[i].nonzero().flatten())
            upto = torch.cat([torch.arange(c), seen + c]) + 10
            m, at = len(upto), c + 40  # the decode step: the same keys at slots `at`.., its own key last
            cache_k[at:at + m], cache_v[at:at + m] = cache_k[upto].clone(), cache_v[upto].clone()
            alone = native_attend(lib(), q[i:i + 1].contiguous(), cache_k, cache_v,
                                  _one_batch(SeqAttention(1, m - 1, slice(at, at + m))), d ** -0.5)
            assert torch.equal(out[i:i + 1], alone)
            ref = attend64(q[i], cache_k[upto], cache_v[upto], d ** -0.5)
            torch.testing.assert_close(out[i].double(), ref, atol=2e-6, rtol=1e-5)


TINY_DIMS = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)


@pytest.fixture(scope="module")
def native_tiny():
    from tiny_models import tiny_hf_model
    from tiny_quant_models import quantized_model

    return quantized_model(tiny_hf_model("qwen2", **TINY_DIMS))  # head_dim 32: C attention; Q8_0, Q4_0 v/down


@pytest.fixture(scope="module")
def native_draft():
    from tiny_models import tiny_hf_model
    from tiny_quant_models import quantized_model

    noisy = tiny_hf_model("qwen2", **TINY_DIMS)
    with torch.no_grad():  # agrees with the target only partly
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.15 * p.abs().mean())
    return quantized_model(noisy)
def test_native_model_takes_the_fused_path_and_agrees_with_the_module_forward(native_tiny):
    from tiny_engines import make_engine

    from specfleet.runtime.step.runner import ForwardItem

    engine = make_engine(native_tiny)
    ids = [5, 9, 22, 31, 7, 64, 2, 11, 40, 3]
    assert native_lib(native_tiny, torch.tensor(ids), engine.runner.kv) is not None

    def logits(fused: bool):
        native_tiny.set_runtime(dataclasses.replace(native_tiny.runtime, fused_native=fused))
        engine.blocks.allocate("p", len(ids))
        try:
            prefix = engine.runner.execute([ForwardItem("p", ids[:6], 0, [5])], engine.blocks)
            rows = engine.runner.execute([ForwardItem("p", ids[6:], 6, [0, 1, 2, 3])], engine.blocks)
        finally:
            engine.blocks.free("p")
        return torch.cat([prefix, rows])

    try:
        fused, modules = logits(True), logits(False)
    finally:
        native_tiny.set_runtime(dataclasses.replace(native_tiny.runtime, fused_native=True))
    scale = modules.abs().max().item()
    assert (fused - modules).abs().max().item() < 2e-2 * scale
    assert torch.equal(fused.argmax(-1), modules.argmax(-1))


@pytest.mark.parametrize("batch", [1, 3])
def test_speculation_is_lossless_through_the_fused_path(native_tiny, native_draft, batch):
    from tiny_engines import LENGTHS, make_engine, repetitive_prompts
    from tiny_models import run_to_completion

    from specfleet.sampling_params import SamplingParams
    from specfleet.strategies.factory import SpecConfig, build

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = repetitive_prompts(LENGTHS[batch])
    plain = [o.token_ids for o in run_to_completion(make_engine(native_tiny), prompts, greedy)]
    for text in ("prompt-lookup", "ngram[min_prob=0.05,top_children=2]", "d1[width=2,nodes=6]"):
        proposer = build(text, SpecConfig(draft_kv_cache_bytes=64 << 10), {"d1": native_draft}.__getitem__, 97)
        engine = make_engine(native_tiny, proposer)
        spec = [o.token_ids for o in run_to_completion(engine, prompts, greedy)]
        assert spec == plain, text
        assert 0 < engine.stats.num_accepted < engine.stats.num_drafted


def test_prompt_chunks_give_the_same_cache_however_they_are_split(native_tiny):
    """A prompt prefilled whole, or in chunks of 6 + 1 + 3 rows (a decode row among them), writes bit for bit
    the same KV cache and hidden states: every row attends over exactly its own keys, so chunking (the
    token budget, preemption and recompute) never changes what later steps read."""
    ids = [5, 9, 22, 31, 7, 64, 2, 11, 40, 3]
    outs = [_prefill_in_chunks(native_tiny, ids, chunks, 32) for chunks in ([10], [6, 1, 3])]
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _prefill_in_chunks(model, ids: list[int], chunks: list[int], at: int) -> tuple:
    """(hidden states of every row, layer 1's keys, its values) of `ids` prefilled chunk by chunk into a fresh
    engine's cache from slot `at`"""
    from tiny_engines import make_engine

    kv = make_engine(model).runner.kv
    hidden, start = [], 0
    for n in chunks:
        seq = SeqAttention(n, start, slice(at, at + start + n))
        slots = torch.arange(at + start, at + start + n)
        hidden.append(model(torch.tensor(ids[start:start + n]), torch.arange(start, start + n),
                            AttentionBatch(slots, [seq]), kv))
        start += n
    end = at + len(ids)
    return torch.cat(hidden), kv.k[1][at:end].clone(), kv.v[1][at:end].clone()


def test_layer_loop_bits_do_not_depend_on_the_threads_or_the_rows_of_a_call(native_tiny):
    """The layer loop runs every layer in one team of threads, with barriers between its products and attention
    (csrc/layers.c): a 40-token prompt whole (from 32 rows the team prepares activation rows together, fewer each
    thread for itself) or in chunks of 33 + 1 + 6 rows, on 1, 2 or 3 threads, gives bit for bit the same hidden
    states and KV cache. A missing barrier or a thread reading another's rows would show here."""
    ids = [(7 * i + 3) % 97 for i in range(40)]
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for chunks in ([40], [33, 1, 6]):
                outs.append((threads, chunks, *_prefill_in_chunks(native_tiny, ids, chunks, 8)))
    finally:
        torch.set_num_threads(before)
    first = outs[0]
    assert first[2].abs().sum() > 0
    for threads, chunks, *tensors in outs[1:]:
        for a, b in zip(first[2:], tensors):
            assert torch.equal(a, b), (threads, chunks)
