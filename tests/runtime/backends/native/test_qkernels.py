"""GGUF block-format weights (runtime/formats/qtensor.py) and their native kernels (runtime/backends/native/csrc/q_*.c).

Two contracts: every product matches a float64 reference built from gguf-py's own dequantization,
and a row's result does not depend on how many rows share the call nor on the thread count (batch
invariance is what keeps speculative verification lossless on these weights). Also: the quantizers,
row selection and lookup, clear errors, and the fallback where the kernels are unavailable."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from specfleet.runtime.backends.native import kernels as native_backend

from specfleet.runtime.formats import qtensor
from specfleet.runtime.formats.qtensor import QTensor, qlinear, quantize, quantize_activations

FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]

needs_native = pytest.mark.skipif(native_backend.missing() is not None,
                                  reason=f"cannot build the kernels here: {native_backend.missing()}")


def random_blocks(qtype, n: int, k: int, seed: int = 0) -> QTensor:
    """Valid random blocks: every byte random (quants, packed 6-bit scales/mins, high bits, any bit
    pattern is valid), then the fp16 scales overwritten with values in a sane range (positive d and
    dmin for Q4_K, as llama.cpp writes them; signed elsewhere)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)

    def put_f16(offset, lo, hi):
        v = rng.uniform(lo, hi, size=(n, k // block)).astype(np.float16)
        raw[:, :, offset:offset + 2] = v.view(np.uint8).reshape(n, k // block, 2)

    if qtype == T.Q6_K:
        put_f16(size - 2, -0.004, 0.004)
    elif qtype == T.Q4_K:
        put_f16(0, 0.0, 0.004)
        put_f16(2, 0.0, 0.004)
    else:
        put_f16(0, -0.05, 0.05)
        if qtype == T.Q4_1:
            put_f16(2, -0.2, 0.2)
    return QTensor(raw.reshape(n, -1), qtype, (n, k))


def dense64(w: QTensor) -> torch.Tensor:
    """float64 [N, K] by gguf-py's dequantizer (independent of ours)."""
    return torch.from_numpy(gguf_dequantize(w.gguf_bytes(), w.qtype).reshape(w.shape).astype(np.float64))


def block_of(qtype) -> int:
    return GGML_QUANT_SIZES[qtype][0]


@needs_native
def test_kernels_build_where_they_can():
    """Where the prerequisites hold the kernels must build (a broken kernel must not hide behind the
    silent fallback)."""
    assert native_backend.available(), native_backend.unavailable_reason()


def test_activation_round_trip_is_the_documented_int8():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0] * 8])
    xq = quantize_activations(x, T.Q8_0)
    assert torch.equal(xq, torch.round(x * 127) / 127)  # amax 1: steps of 1/127, half to even
    assert torch.equal(quantize_activations(torch.zeros(2, 256), T.Q4_K), torch.zeros(2, 256))


@needs_native
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 7, 70])  # N below, at and past a scheduled chunk, not a multiple of one
def test_kernel_matches_float64_reference(qtype, n):
    """Tight (per output, relative to its sum of |terms|) against float64 of (gguf-py's dequantized W)
    x (x after the kernel's own int8 round trip); loose against the exact product. Every M from 1 to
    33 covers each row-tile tail; K is three blocks."""
    k = 3 * block_of(qtype)
    w = random_blocks(qtype, n, k, seed=n)
    wd = dense64(w)
    torch.manual_seed(n)
    x = torch.randn(33, k) * torch.linspace(0.1, 3.0, k)  # blocks of very different magnitudes
    for m in range(1, 34):
        y = qlinear(x[:m].contiguous(), w)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        xq = quantize_activations(x[:m], qtype).double()
        tight = xq @ wd.t()
        assert ((y.double() - tight).abs() <= 2e-6 * (xq.abs() @ wd.abs().t()) + 1e-30).all(), (qtype.name, m)
        exact = x[:m].double() @ wd.t()
        assert ((y.double() - exact).abs() <= 0.02 * (x[:m].double().abs() @ wd.abs().t())).all()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_k_formats_are_kept_in_the_kernels_order_and_give_the_file_bytes_back(qtype):
    """A K-format QTensor holds its quants re-ordered (csrc/q_kquants.c); `gguf_bytes` gives back exactly
    the bytes it was built from, the C and numpy re-orderings agree, and select/cat keep the order."""
    rng = np.random.default_rng(3)
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(9, 2 * size), dtype=np.uint8)
    w = QTensor(raw, qtype, (9, 512))
    assert not np.array_equal(w.data.numpy(), raw)  # re-ordered, so the kernels read the new order
    assert np.array_equal(w.gguf_bytes(), raw)
    assert np.array_equal(qtensor.pack_k(raw, qtype, native=False), w.data.numpy())
    assert np.array_equal(qtensor.unpack_k(qtensor.pack_k(raw, qtype), qtype), raw)
    assert np.array_equal(w.select_rows([4, 1]).gguf_bytes(), raw[[4, 1]])
    assert np.array_equal(QTensor.cat([w, w.select_rows([0])]).gguf_bytes(), np.concatenate([raw, raw[:1]]))
    assert np.array_equal(QTensor(w.data, qtype, (9, 512), packed=True).gguf_bytes(), raw)


@needs_native
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_k_kernels_do_not_overflow_their_int16_sums(qtype, sign):
    """The K kernels add maddubs results in int16 before scaling (Q4_K over a whole block, Q6_K over
    two registers): with every quant at its largest and every activation at +-127 those sums reach
    +-30480 and +-32004. A wrapped or saturated sum would be far off the float64 reference."""
    n, k = 5, 512
    size = GGML_QUANT_SIZES[qtype][1]
    raw = np.zeros((n, k // 256, size), np.uint8)
    if qtype == T.Q4_K:
        raw[:, :, 4:8] = 0xFF  # sc[0..3] = 63 and the top two bits of sc[4..7] (every min stays 0)
        raw[:, :, 12:16] = 0x0F  # the low four bits of sc[4..7]: 63
        raw[:, :, 16:] = 0xFF  # every quant 15
        raw[:, :, 0:2] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    else:
        raw[:, :, :192] = 0xFF  # every quant 63
        raw[:, :, 192:208] = 127  # scales
        raw[:, :, 208:210] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    w = QTensor(raw.reshape(n, -1), qtype, (n, k))
    wd = dense64(w)
    assert (wd != 0).all()
    x = torch.full((12, k), sign)  # 3 rows, and 12: two groups of 6 in one pass on the AVX2 path (DEFINE_COLUMNS_WIDE)
    x[3:] *= torch.linspace(0.5, 1.0, 9)[:, None]
    y = qlinear(x, w).double()
    ref = quantize_activations(x, qtype).double() @ wd.t()
    assert torch.allclose(y, ref, rtol=1e-5), (y, ref)
    assert torch.equal(qlinear(x[:3], w), y[:3].float())


@needs_native
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_rows_are_bit_identical_whatever_shares_the_call(qtype):
    """A row's output is the same alone, among all rows, shifted into other tiles and chunks, against a
    slice of the weight rows, and under another thread count: verifying k+1 tokens gives each what
    decoding it alone gives."""
    n, k = 133, 6 * block_of(qtype)
    w = random_blocks(qtype, n, k, seed=7)
    torch.manual_seed(1)
    x = torch.randn(70, k)
    full = qlinear(x, w)
    for i in range(0, 70, 3):
        assert torch.equal(full[i:i + 1], qlinear(x[i:i + 1].contiguous(), w)), i
    for a, b in [(0, 2), (0, 3), (3, 8), (0, 9), (1, 10), (0, 16), (0, 17), (7, 24), (5, 70), (30, 37)]:
        assert torch.equal(full[a:b], qlinear(x[a:b].contiguous(), w)), (a, b)
    # nor on which weight rows share the call: a fused q/k/v or gate/up gives each part's outputs exactly
    for a, b in [(0, 1), (5, 70), (17, 133)]:
        assert torch.equal(full[:, a:b], qlinear(x, w.select_rows(slice(a, b))))
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(full, qlinear(x, w)), t
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_concurrent_calls_from_python_threads():
    """ctypes releases the GIL, so a drafter thread's products overlap the target's: each call keeps its
    own scratch and OpenMP team, and every result equals the serial one."""
    import threading

    ws = [random_blocks(q, 96, 512, seed=i) for i, q in enumerate((T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0))]
    xs = [torch.randn(m, 512) for m in (1, 3, 9, 33)]
    serial = [[qlinear(x, w) for x in xs] for w in ws]
    failures = []

    def work(i):
        for _ in range(20):
            for j, x in enumerate(xs):
                if not torch.equal(qlinear(x, ws[i]), serial[i][j]):
                    failures.append((i, j))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(ws))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@needs_native
def test_kernel_at_model_shapes_with_bias():
    """K of the 1.5B's hidden size (six super-blocks), many scheduled chunks of rows, with a bias."""
    for qtype in (T.Q4_K, T.Q6_K, T.Q8_0):
        n, k = 300, 1536
        w = random_blocks(qtype, n, k, seed=3)
        x = torch.randn(5, k)
        bias = torch.randn(n)
        y = qlinear(x, w, bias)
        ref = quantize_activations(x, qtype).double() @ dense64(w).t() + bias.double()
        torch.testing.assert_close(y.double(), ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype,bits", [(T.Q8_0, 8), (T.Q4_0, 4), (T.Q4_1, 4), (T.Q5_0, 5), (T.Q4_K, 4)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_quantize_round_trip(qtype, bits):
    """dequantize(quantize(w)) is within a step of the row's range (loosely: the bound shrinks with the
    bits), and our dequantizer reads what gguf-py reads."""
    torch.manual_seed(2)
    w = torch.randn(24, 512) * 0.05
    q = quantize(w, qtype)
    assert q.qtype == qtype and q.shape == (24, 512) and q.data.dtype == torch.uint8
    back = q.dequantize()
    err = (back - w).abs().amax(dim=1) / w.abs().amax(dim=1)
    assert err.max() < 2 / (2 ** bits - 1), float(err.max())
    torch.testing.assert_close(back.double(), dense64(q))


def test_q4_k_quantizer_uses_the_mins():
    """Rows offset below zero keep their precision: the per-sub-block min carries the offset (Q4_K's
    min only subtracts, w = d*sc*q - dmin*mn, so it serves negative offsets; without it a step would
    span 5/15 and the error reach 0.17)."""
    torch.manual_seed(4)
    w = torch.rand(8, 256) - 5.0
    err = (quantize(w, T.Q4_K).dequantize() - w).abs().max()
    assert err < 0.1, float(err)


def test_rows_select_cat_and_lookup_agree_with_dequantize():
    for qtype in (T.Q4_K, T.Q6_K, T.Q5_0):
        w = random_blocks(qtype, 10, 512, seed=5)
        dense = w.dequantize()
        assert w.dequantize(torch.bfloat16).dtype == torch.bfloat16
        ids = torch.tensor([3, 0, 9, 3])
        assert torch.equal(w.dequantize_rows(ids), dense[ids])
        assert torch.equal(w.select_rows(ids).dequantize(), dense[ids])
        assert torch.equal(w.select_rows(slice(2, 6)).dequantize(), dense[2:6])
        both = QTensor.cat([w, w.select_rows([1, 2])])
        assert both.shape == (12, 512) and torch.equal(both.dequantize(), torch.cat([dense, dense[1:3]]))
        assert w.nbytes == 10 * 512 // block_of(qtype) * GGML_QUANT_SIZES[qtype][1]
        with pytest.raises(IndexError, match="row ids"):
            w.select_rows([10])


def test_construction_wraps_read_only_memory_without_copying(recwarn):
    """Q4_1, the one format the kernels read in the file's order, wraps a read-only map as it is."""
    raw = np.ascontiguousarray(random_blocks(T.Q4_1, 4, 64).data.numpy())
    raw.setflags(write=False)
    w = QTensor(raw, T.Q4_1, (4, 64))
    assert w.data.data_ptr() == raw.__array_interface__["data"][0]
    assert not [r for r in recwarn if "writable" in str(r.message)]
    padded = torch.zeros(4, 2 * 40, dtype=torch.uint8)  # rows with a stride: copied, so the kernel reads rows
    padded[:, :40] = w.data
    strided = QTensor(padded[:, :40], T.Q4_1, (4, 64))
    x = torch.randn(3, 64)
    assert strided.data.is_contiguous() and torch.equal(qlinear(x, strided), qlinear(x, w))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_0, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("nb", [1, 3, 4, 8, 12, 28, 35])
def test_grouped_formats_are_kept_in_the_kernels_order_and_give_the_file_bytes_back(qtype, nb):
    """Q4_0, Q5_0 and Q8_0 rows are re-ordered in groups of eight blocks (csrc/q_common.h; a last group of
    nb % 8): `gguf_bytes` gives back exactly the file's bytes, the C and numpy orders agree, a block's
    quants really move (so the kernels read the new order), and select/cat keep it."""
    rng = np.random.default_rng(nb)
    size = GGML_QUANT_SIZES[qtype][1]
    k = 32 * nb
    raw = rng.integers(0, 256, size=(9, nb * size), dtype=np.uint8)
    w = QTensor(raw, qtype, (9, k))
    if nb > 1:
        assert not np.array_equal(w.data.numpy(), raw)
    assert np.array_equal(w.gguf_bytes(), raw)
    assert np.array_equal(qtensor.pack_rows(raw, qtype, k, native=False), w.data.numpy())
    assert np.array_equal(qtensor.unpack_rows(qtensor.pack_rows(raw, qtype, k, native=False), qtype, k), raw)
    assert np.array_equal(w.select_rows([4, 1]).gguf_bytes(), raw[[4, 1]])
    assert np.array_equal(QTensor.cat([w, w.select_rows([0])]).gguf_bytes(), np.concatenate([raw, raw[:1]]))
    # the layout itself, spelled out for one group: block j's weight 4k + t sits at byte 4 (nt k + j) + t
    nt = min(nb, 8)
    blocks = raw[0, :nt * size].reshape(nt, size)
    d = w.data.numpy()[0, :2 * nt]
    assert np.array_equal(d, blocks[:, :2].reshape(-1))
    from specfleet.runtime.formats.group32_order import _natural
    nat = _natural(blocks, qtype)  # [nt, 32] weights in order
    body = w.data.numpy()[0, 2 * nt:nt * size]
    if qtype == T.Q8_0:
        q = body
    else:
        qs = body[4 * nt:] if qtype == T.Q5_0 else body
        q = np.concatenate([qs & 15, qs >> 4])
        if qtype == T.Q5_0:
            q = q | (np.unpackbits(body[:4 * nt], bitorder="little") << 4)
    for j in range(nt):
        for e in range(32):
            assert q[4 * (nt * (e // 4) + j) + e % 4] == nat[j, e]


def test_bad_input_is_a_clear_error():
    w = random_blocks(T.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="not a supported block format"):
        QTensor(np.zeros((4, 84), np.uint8), T.Q2_K, (4, 256))
    with pytest.raises(ValueError, match="multiple of 32"):
        QTensor(np.zeros(40, np.uint8), T.Q4_0, (1, 40))
    with pytest.raises(ValueError, match="needs 36 bytes"):
        QTensor(np.zeros(70, np.uint8), T.Q4_0, (1, 64))
    with pytest.raises(ValueError, match="fp32"):
        qlinear(torch.randn(2, 64).bfloat16(), w)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        qlinear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="bias"):
        qlinear(torch.randn(2, 64), w, torch.randn(5))
    with pytest.raises(TypeError, match="QTensor weight"):
        qlinear(torch.randn(2, 64), torch.randn(4, 64))
    with pytest.raises(ValueError, match="formats and K must match"):
        QTensor.cat([w, quantize(torch.randn(4, 64), T.Q8_0)])
    with pytest.raises(ValueError, match="at least one"):
        QTensor.cat([])
    with pytest.raises(ValueError, match="cannot quantize to Q6_K"):
        quantize(torch.randn(4, 256), T.Q6_K)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(torch.randn(4, 64), T.Q4_K)


def _turn_off(monkeypatch, tmp_path):
    """SPECFLEET_NATIVE=0 for the rest of the test; the backend forgets its library now and again after the
    environment is restored, so the next test loads the real one."""
    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECFLEET_NATIVE", "0")
    monkeypatch.setattr(native_backend, "_libs", {})  # restored with the environment
    monkeypatch.setattr(native_backend, "_reasons", {})
    monkeypatch.setattr(native_backend, "_default", None)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_fallback_equals_the_kernel_and_says_why(qtype, monkeypatch, tmp_path):
    """Without the kernels (SPECFLEET_NATIVE=0) qlinear computes the kernel's quantity with torch:
    equal to it up to fp32 rounding, in row chunks across FALLBACK_ROWS."""
    monkeypatch.setattr(qtensor, "FALLBACK_ROWS", 16)
    n, k = 45, 2 * block_of(qtype)
    w = random_blocks(qtype, n, k, seed=9)
    x = torch.randn(6, k)
    bias = torch.randn(n)
    native_y = qlinear(x, w, bias) if native_backend.available() else None
    _turn_off(monkeypatch, tmp_path)
    assert not native_backend.available()
    assert "SPECFLEET_NATIVE=0" in native_backend.unavailable_reason()
    y = qlinear(x, w, bias)
    ref = quantize_activations(x, qtype).double() @ dense64(w).t() + bias.double()
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
    if native_y is not None:
        torch.testing.assert_close(y, native_y, atol=1e-4, rtol=1e-5)
    monkeypatch.undo()  # the real kernel state comes back for the other tests
