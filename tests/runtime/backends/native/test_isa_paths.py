"""The block-format kernels' ISA paths (runtime/backends/native/kernels.py ISA_PATHS: AVX2, AVX-VNNI, AVX512-VNNI,
and the plain-C generic path any machine with a compiler builds; the ARM path is tests/runtime/backends/native/test_arm_qemu.py's).

Contract: every path the CPU can run computes bit for bit what the AVX2 path computes, for every format,
every row count (each row-tile tail) and through the fused entry point with its input transforms. So the
path changes speed only, and the batch invariance that keeps verification lossless (tests/runtime/backends/native/test_qkernels.py)
carries over to each. Paths the CPU lacks are skipped with the reason; the control shows the comparison
can fail."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from specfleet.runtime.backends.native import build as native

from specfleet.runtime.backends.native import kernels as native_backend

from specfleet.runtime.formats import qtensor
from specfleet.runtime.backends.native.kernels import PRE_NONE, PRE_RMSNORM, PRE_SILU_MUL
from specfleet.runtime.formats.qtensor import fused_parts, run_fused, run_qlinear
from tests.runtime.backends.native.test_qkernels import FORMATS, block_of, random_blocks

FAST_PATHS = [p for p in native_backend.ISA_PATHS if p != "avx2" and native_backend.FAMILY[p] in ("x86", "generic")]


def _lib_or_skip(path: str):
    if not native_backend._pinnable(path):
        needs = native_backend.ISA_PATHS[path][0]
        pytest.skip(f"this CPU cannot run the {path} kernels (needs {', '.join(needs)}; "
                    f"has {sorted(f for f in native.cpu_flags() if 'avx' in f) or 'none of them'})")
    lib = native_backend.library(path)
    assert lib is not None, native_backend._reasons.get(path)
    return lib


def test_the_best_runnable_path_is_chosen_and_named():
    paths = native_backend.runnable_isas()
    if not paths:
        pytest.skip(f"no native kernels here: {native_backend.missing()}")
    assert native_backend.isa() == paths[0]
    assert "avx2" in paths
    for path in paths:  # each library says which path it was built for (checked at load, too)
        assert _lib_or_skip(path).specfleet_q_isa().decode() == path


def test_a_path_the_cpu_lacks_or_an_unknown_one_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SPECFLEET_ISA", "avx9000")
    with pytest.raises(ValueError, match="not a kernel path"):
        native_backend.isa()
    missing = [p for p in native_backend.ISA_PATHS if not native_backend._pinnable(p)]
    if missing and native_backend.runnable_isas():
        monkeypatch.setenv("SPECFLEET_ISA", missing[0])
        with pytest.raises(ValueError, match="cannot run it"):
            native_backend.isa()


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [5, 13, 28])  # 32-weight formats: a tail group of 5; one group of 8 and a tail
# of 5; three groups of 8 and one of 4
@pytest.mark.parametrize("group_rows", [(2, 0, 0, 0), (7, 0, 1, 0), (7, 1000, 1, 0), (2, 0, 0, 12288)])  # weight rows
# in groups from 2 activation rows (the compiled default), or row by row below 7 (a Zen 4's setting is 6), or that but
# in groups from 2 rows past 1000 bytes of activations; the middle two prefetching into L2, the last with a second
# prefetch 12 KB ahead into L2 (an AMX Xeon's setting): whichever the CPU's setting, all ways are checked
def test_every_path_gives_the_avx2_bits(path, qtype, blocks, group_rows):
    fast, base = _lib_or_skip(path), _lib_or_skip("avx2")
    if blocks != 5 and block_of(qtype) == 256:
        pytest.skip("K formats: five blocks cover them")
    k = blocks * block_of(qtype)
    torch.manual_seed(int(qtype))
    x = torch.randn(33, k) * torch.logspace(-2, 1, k)  # activations of very different sizes per block
    before = native_backend.tuning(path)
    fast.specfleet_set_grouping(*group_rows[:2])
    fast.specfleet_set_prefetch(-1, -1, -1, group_rows[2])
    fast.specfleet_set_prefetch_far(group_rows[3], group_rows[3])
    try:
        for n in (37, 38, 39):  # weight rows in fours (the 512-bit Q4_K path), then 1, 2 or 3 left over
            w = random_blocks(qtype, n, k, seed=3)
            want = run_qlinear(base, x, w)
            for m in (1, 2, 5, 7, 8, 9, 16, 17, 32, 33):  # decode, tile tails (TILE 8, QUAD_TILE 16), several tiles
                assert torch.equal(run_qlinear(fast, x[:m], w), want[:m]), f"{path} {qtype.name} rows={m} n={n}"
    finally:
        fast.specfleet_set_grouping(before["group_min_rows"], before["group_act_bytes"])
        fast.specfleet_set_prefetch(-1, -1, -1, int(before["prefetch_l2"]))
        fast.specfleet_set_prefetch_far(*before["prefetch_far"])


def test_a_best_path_that_does_not_build_falls_back_to_the_next(monkeypatch):
    """A CPU whose best path cannot be built here (a compiler without that path's flags) keeps native kernels: the
    next path it runs, named as the one in use."""
    paths = native_backend.runnable_isas()
    if len(paths) < 2:
        pytest.skip(f"one runnable path here ({paths})")
    monkeypatch.delenv("SPECFLEET_ISA", raising=False)
    monkeypatch.setattr(native_backend, "_default", None)
    monkeypatch.setitem(native_backend._libs, paths[0], None)  # as if its build had failed
    lib = native_backend.library()
    assert lib is not None and lib.specfleet_q_isa().decode() == paths[1]
    assert native_backend.isa() == paths[1]


def test_amx_tiles_give_the_vnni_bits_over_a_prompts_rows():
    """The amx path's Q4_K products over 32 and more activation rows run on the tile unit (csrc/arch/x86/amx_k.h):
    several 16-row tiles per call and a short last one, weight rows past the last group of 16, two calls' chunks of
    64 rows, the 1.5B's widths; each row's bits must be the 512-bit VNNI path's (and so the AVX2 path's)."""
    amx, vnni = _lib_or_skip("amx"), _lib_or_skip("avx512vnni")
    assert amx.specfleet_amx_tiles() == 1, "the OS refused the tile state: these bits would be the VNNI kernels'"
    torch.manual_seed(43)
    for n, k in ((70, 1536), (40, 2304)):
        w = random_blocks(T.Q4_K, n, k, seed=n)
        x = torch.randn(130, k) * torch.logspace(-2, 1, k)
        want = run_qlinear(vnni, x, w)
        for m in (31, 32, 33, 47, 64, 65, 130):
            assert torch.equal(run_qlinear(amx, x[:m], w), want[:m]), f"rows={m} n={n} k={k}"


def _q_linear_into(lib, x: torch.Tensor, w, act: torch.Tensor) -> torch.Tensor:
    """run_qlinear with the caller's activation buffer, as the model's products reuse theirs"""
    n, k = w.shape
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    rc = lib.specfleet_q_linear(int(w.qtype), w.data.data_ptr(), w.data.shape[1], n, k, x.data_ptr(), x.shape[0],
                                y.data_ptr(), act.data_ptr(), torch.get_num_threads())
    assert rc == 0
    return y


def test_amx_tiles_never_reuse_a_layout_for_other_rows():
    """A thread keeps each 64-row chunk's tile layout for the rest of its call (csrc/arch/x86/amx_k.h): new rows in
    the same buffer (one row changed, or all), the fused products' buffers that malloc hands out again, and calls from
    two threads at once must each get their own rows' VNNI bits, never a layout kept from other rows."""
    amx, vnni = _lib_or_skip("amx"), _lib_or_skip("avx512vnni")
    assert amx.specfleet_amx_tiles() == 1, "the OS refused the tile state: these bits would be the VNNI kernels'"
    torch.manual_seed(7)
    k = 1536
    w = random_blocks(T.Q4_K, 200, k, seed=11)  # four chunks of 64 weight rows: three calls reuse a chunk's layout
    act = torch.empty(130 * amx.specfleet_q_act_row_bytes(int(T.Q4_K), k), dtype=torch.uint8)
    x1 = torch.randn(130, k)
    x2 = x1.clone()
    x2[70] *= -1.0  # one row of the second chunk differs
    x3 = torch.randn(130, k)
    for x in (x1, x2, x3, x1):
        assert torch.equal(_q_linear_into(amx, x, w, act), run_qlinear(vnni, x, w))
    parts = [(w, None)]
    arr = fused_parts(parts)
    for x in (x1, x2, x3):
        got = run_fused(amx, arr, 1, k, x, torch.empty(130, 200))
        assert torch.equal(got, run_qlinear(vnni, x, w))
    import threading
    inputs = [torch.randn(96, k) for _ in range(4)]
    wants = [run_qlinear(vnni, x, w) for x in inputs]
    bad = []

    def worker(i):
        buf = torch.empty_like(act)
        for rep in range(12):
            j = (i + rep) % len(inputs)
            if not torch.equal(_q_linear_into(amx, inputs[j], w, buf), wants[j]):
                bad.append((i, rep))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, f"calls that got another call's layout: {bad}"


@pytest.mark.parametrize("path", FAST_PATHS)
def test_fused_products_give_the_avx2_bits(path):
    """q/k/v-style parts of mixed formats behind RMSNorm, and a SiLU * up product added to its output."""
    fast, base = _lib_or_skip(path), _lib_or_skip("avx2")
    k = 512
    parts = [(random_blocks(t, n, k, seed=n), torch.randn(n) if t == T.Q5_0 else None)
             for t, n in ((T.Q4_K, 40), (T.Q6_K, 24), (T.Q5_0, 24), (T.Q8_0, 8))]
    arr = fused_parts(parts)
    cols = sum(w.shape[0] for w, _ in parts)
    torch.manual_seed(0)
    x, norm_w = torch.randn(11, k), torch.rand(k) + 0.5
    outs = [run_fused(lib, arr, len(parts), k, x, torch.empty(11, cols), PRE_RMSNORM, norm_w, 1e-6)
            for lib in (fast, base)]
    assert torch.equal(outs[0], outs[1])
    down = [(random_blocks(T.Q6_K, 16, k, seed=5), None)]
    darr = fused_parts(down)
    gu = torch.randn(11, 2 * k)
    res = [run_fused(lib, darr, 1, k, gu, torch.ones(11, 16), PRE_SILU_MUL, accumulate=True) for lib in (fast, base)]
    assert torch.equal(res[0], res[1])
    plain = [run_fused(lib, darr, 1, k, x, torch.empty(11, 16), PRE_NONE) for lib in (fast, base)]
    assert torch.equal(plain[0], plain[1])


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("heads,kv_heads,d", [(12, 2, 128), (14, 2, 64), (4, 4, 32), (7, 1, 96)])
def test_attention_gives_the_avx2_bits(path, heads, kv_heads, d):
    """Attention (scores, softmax, the weighted sum of values) in wider registers: every length around the 8- and
    16-key chunks, an odd number of query heads per KV head, head sizes that are and are not multiples of 64,
    rows over a prefix and a tree row over gathered keys."""
    from specfleet.runtime.model.attention import AttentionBatch, SeqAttention
    from specfleet.runtime.step.plan import native_attend

    fast, base = _lib_or_skip(path), _lib_or_skip("avx2")
    g = torch.Generator().manual_seed(heads * d)
    for length in (1, 7, 8, 9, 15, 16, 17, 24, 25, 70, 300):
        k = torch.randn(length + 3, kv_heads, d, generator=g)
        v = torch.randn(length + 3, kv_heads, d, generator=g)
        q = torch.randn(6, heads, d, generator=g) * 3
        tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)  # row 2 skips row 1: gathered keys
        seqs = [SeqAttention(1, length - 1, slice(0, length)), SeqAttention(2, length + 1, slice(0, length + 3)),
                SeqAttention(3, length, slice(0, length + 3), new_mask=torch.from_numpy(tree), host_mask=tree)]
        batch = AttentionBatch(torch.zeros(6, dtype=torch.long), seqs)
        outs = [native_attend(lib, q, k, v, batch, d ** -0.5) for lib in (fast, base)]
        assert torch.equal(outs[0], outs[1]), f"{path} length={length}"


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("d", [128, 64, 32, 12])
def test_rotary_gives_the_avx2_bits(path, d):
    fast, base = _lib_or_skip(path), _lib_or_skip("avx2")
    heads, kv_heads, t = 6, 2, 5
    torch.manual_seed(d)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    cos, sin = torch.randn(64, d), torch.randn(64, d)
    pos, slots = torch.tensor([3, 7, 8, 20, 63]), torch.tensor([9, 0, 4, 5, 11])
    res = []
    for lib in (fast, base):
        q, kc, vc = torch.empty(t, heads, d), torch.zeros(12, kv_heads, d), torch.zeros(12, kv_heads, d)
        lib.specfleet_rope_kv(qkv.data_ptr(), t, qkv.stride(0), heads, kv_heads, d, pos.data_ptr(), cos.data_ptr(),
                              sin.data_ptr(), q.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr())
        res.append((q, kc, vc))
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_control_a_changed_weight_changes_the_bits():
    """The comparison above can fail: one weight block changed in one row changes that row's output."""
    base = _lib_or_skip("avx2")
    w = random_blocks(T.Q4_K, 4, 256, seed=1)
    x = torch.randn(3, 256)
    data = w.data.clone()
    data[2, 40] ^= 0x11
    other = qtensor.QTensor(data, T.Q4_K, w.shape, packed=True)
    a, b = run_qlinear(base, x, w), run_qlinear(base, x, other)
    assert torch.equal(a[:, :2], b[:, :2]) and not torch.equal(a[:, 2], b[:, 2])
    assert np.array_equal(a[:, 3].numpy(), b[:, 3].numpy())


def _each_refused(monkeypatch, env: str, setting, *bad_values: str) -> None:
    """Each malformed value of override `env` makes `setting` raise a ValueError that names the variable."""
    for bad in bad_values:
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            setting("avx2")


def test_prefetch_distances_by_vendor_and_override(monkeypatch, caplog):
    """The x86 products' prefetch settings (speed only): the compiled default unless PREFETCH names the path and
    vendor (Intel's 512-bit VNNI path: 4 KB for verification rows, measured on a Cascade Lake; a Zen 4: 16 KB for
    weight rows in groups, more rows into L2) or SPECFLEET_PREFETCH overrides; a malformed override is named and
    ignored, and the kernels still load."""
    monkeypatch.delenv("SPECFLEET_PREFETCH", raising=False)
    assert native_backend.prefetch_setting("avx512vnni", "GenuineIntel", 6) == (4096, 4096, 4096, 0)
    assert native_backend.prefetch_setting("amx", "GenuineIntel", 6) == (4096, 4096, 4096, 0)  # the VNNI path's
    assert native_backend.prefetch_setting("avx512vnni", "AuthenticAMD", 26) is None  # Zen 5: the compiled default
    assert native_backend.prefetch_setting("avx512vnni", "AuthenticAMD", 25) == (4096, 4096, 16384, 1)  # Zen 4
    assert native_backend.prefetch_setting("avx2", "GenuineIntel", 6) is None
    assert native_backend.prefetch_setting("avx2", "AuthenticAMD", 25) == (4096, 4096, 4096, 1)  # Zen 3 and 4
    monkeypatch.setenv("SPECFLEET_PREFETCH", "2048,8192")
    assert native_backend.prefetch_setting("avx2", "AuthenticAMD") == (2048, 8192, -1, -1)  # the rest kept
    monkeypatch.setenv("SPECFLEET_PREFETCH", "2048,8192,4096,1")
    assert native_backend.prefetch_setting("avx2", "AuthenticAMD") == (2048, 8192, 4096, 1)
    _each_refused(monkeypatch, "SPECFLEET_PREFETCH", native_backend.prefetch_setting,
                  "8192", "a,b", "1,-1", "1,9999999", "1,2,3", "1,2,3,2")
    paths = [p for p in native_backend.runnable_isas() if native_backend.FAMILY[p] == "x86"]
    if not paths:
        pytest.skip("no x86 kernel path runs here")
    import ctypes
    lib = native_backend.library(paths[0])
    distances = (ctypes.c_int64 * 3).in_dll(lib, "sf_prefetch_bytes")  # the loaded library's globals (dlopen shares)
    before = tuple(distances) + (ctypes.c_int64.in_dll(lib, "sf_prefetch_l2").value,)
    try:
        monkeypatch.setenv("SPECFLEET_PREFETCH", "1234,5678,9012,1")
        native_backend._load(paths[0])
        assert tuple(distances) == (1234, 5678, 9012) and native_backend.tuning(paths[0])["prefetch_l2"]
        monkeypatch.setenv("SPECFLEET_PREFETCH", "2345,6789")  # the grouped distance and L2 kept
        native_backend._load(paths[0])
        assert tuple(distances) == (2345, 6789, 9012) and native_backend.tuning(paths[0])["prefetch_l2"]
        monkeypatch.setenv("SPECFLEET_PREFETCH", "oops")
        assert native_backend._load(paths[0]) is not None
        assert "keeping the compiled prefetch distances" in caplog.text and tuple(distances) == (2345, 6789, 9012)
    finally:
        lib.specfleet_set_prefetch(*before)


def test_far_prefetch_on_an_amx_xeon_and_override(monkeypatch, caplog):
    """The second prefetch into L2 (speed only; the bits are checked with it on above): 12 KB ahead for one row and for
    more on an Intel CPU with the tile unit running a 512-bit path, 6 KB for more rows on a Zen 5's 512-bit path, none
    elsewhere (the compiled default), unless SPECFLEET_PREFETCH_FAR overrides; a malformed override is named and
    ignored, and the kernels still load."""
    monkeypatch.delenv("SPECFLEET_PREFETCH_FAR", raising=False)
    amx_xeon = frozenset({"avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"})
    assert native_backend.prefetch_far_setting("amx", "GenuineIntel", amx_xeon) == (12288, 12288)
    assert native_backend.prefetch_far_setting("avx512vnni", "GenuineIntel", amx_xeon) == (12288, 12288)
    assert native_backend.prefetch_far_setting("avx2", "GenuineIntel", amx_xeon) is None
    assert native_backend.prefetch_far_setting("avx512vnni", "GenuineIntel", amx_xeon - {"amx_tile"}) is None
    assert native_backend.prefetch_far_setting("avx512vnni", "AuthenticAMD", amx_xeon, 25) is None
    # a Zen 5 (AMD family 26) on the 512-bit path: for more rows only, 6 KB ahead; its AVX2 path keeps none
    assert native_backend.prefetch_far_setting("avx512vnni", "AuthenticAMD", frozenset(), 26) == (0, 6144)
    assert native_backend.prefetch_far_setting("avx2", "AuthenticAMD", frozenset(), 26) is None
    assert native_backend.prefetch_far_setting("avx512vnni", "GenuineIntel", frozenset(), 26) is None
    monkeypatch.setenv("SPECFLEET_PREFETCH_FAR", "0,8192")
    assert native_backend.prefetch_far_setting("avx2", "AuthenticAMD", frozenset()) == (0, 8192)
    _each_refused(monkeypatch, "SPECFLEET_PREFETCH_FAR", native_backend.prefetch_far_setting,
                  "8192", "a,b", "1,-1", "1,9999999", "1,2,3")
    paths = [p for p in native_backend.runnable_isas() if native_backend.FAMILY[p] == "x86"]
    if not paths:
        pytest.skip("no x86 kernel path runs here")
    lib = native_backend.library(paths[0])
    before = native_backend.tuning(paths[0])["prefetch_far"]
    try:
        monkeypatch.setenv("SPECFLEET_PREFETCH_FAR", "1234,5678")
        native_backend._load(paths[0])
        assert native_backend.tuning(paths[0])["prefetch_far"] == [1234, 5678]
        monkeypatch.setenv("SPECFLEET_PREFETCH_FAR", "oops")
        assert native_backend._load(paths[0]) is not None
        assert "keeping the compiled far prefetch" in caplog.text
        assert native_backend.tuning(paths[0])["prefetch_far"] == [1234, 5678]
    finally:
        lib.specfleet_set_prefetch_far(*before)


def test_one_row_chunks_on_an_amx_xeon_and_override(monkeypatch, caplog):
    """How many bytes of weight rows a one-row product hands a thread at once (speed only): 128 KB on an Intel CPU
    with the tile unit running a 512-bit path, 256 KB on a Zen 5's, else 64 rows (the compiled default), unless
    SPECFLEET_CHUNK_BYTES overrides; a malformed override is named and ignored. And whatever the chunks, every output
    keeps its bits."""
    monkeypatch.delenv("SPECFLEET_CHUNK_BYTES", raising=False)
    amx_xeon = frozenset({"avx2", "avx512f", "avx512_vnni", "amx_tile"})
    assert native_backend.chunk_bytes_setting("amx", "GenuineIntel", amx_xeon) == 131072
    assert native_backend.chunk_bytes_setting("avx2", "GenuineIntel", amx_xeon) is None
    assert native_backend.chunk_bytes_setting("avx512vnni", "AuthenticAMD", amx_xeon, 25) is None
    assert native_backend.chunk_bytes_setting("avx512vnni", "AuthenticAMD", frozenset(), 26) == 262144  # a Zen 5
    assert native_backend.chunk_bytes_setting("avx2", "AuthenticAMD", frozenset(), 26) is None
    monkeypatch.setenv("SPECFLEET_CHUNK_BYTES", "0")
    assert native_backend.chunk_bytes_setting("avx2", "AuthenticAMD", frozenset()) == 0
    _each_refused(monkeypatch, "SPECFLEET_CHUNK_BYTES", native_backend.chunk_bytes_setting,
                  "x", "-1", str(1 << 25), "1,2")
    lib = native_backend.library()
    if lib is None:
        pytest.skip("no native kernels here")
    before = native_backend.tuning()["chunk_bytes"]
    torch.manual_seed(5)
    w = random_blocks(T.Q4_K, 300, 512, seed=5)  # 300 rows of 288 B: 5 chunks of 64 rows, or 2 of 256 (64 KB)
    x = torch.randn(1, 512)
    try:
        lib.specfleet_set_chunk_bytes(0)
        want = run_qlinear(lib, x, w)
        for b in (1, 65536, 1 << 20):
            lib.specfleet_set_chunk_bytes(b)
            assert native_backend.tuning()["chunk_bytes"] == b
            assert torch.equal(run_qlinear(lib, x, w), want), b
        monkeypatch.setenv("SPECFLEET_CHUNK_BYTES", "oops")
        assert native_backend._load(native_backend.isa()) is not None
        assert "keeping the compiled chunks" in caplog.text
    finally:
        lib.specfleet_set_chunk_bytes(before)


def test_guided_schedule_on_a_zen5_and_override(monkeypatch, caplog):
    """How the products hand their chunks to threads (speed only): in guided runs, and for fused products over few rows
    in one run a thread, on a Zen 5's 512-bit path (AMD family 26), else one at a time (the compiled default), unless SPECFLEET_SCHEDULE overrides; a bad override is named and
    ignored. And whichever way (one run of equal bytes a thread included), on two or three threads, every output of a
    plain and a fused product keeps its bits, for one activation row and for several."""
    monkeypatch.delenv("SPECFLEET_SCHEDULE", raising=False)
    assert native_backend.schedule_setting("avx512vnni", "AuthenticAMD", 26) == 2
    assert native_backend.schedule_setting("amx", "AuthenticAMD", 26) == 2  # `amx` is tuned as avx512vnni
    assert native_backend.schedule_setting("avx512vnni", "AuthenticAMD", 25) is None
    assert native_backend.schedule_setting("avx2", "AuthenticAMD", 26) is None
    assert native_backend.schedule_setting("avx512vnni", "GenuineIntel", 6) is None
    for text, want in (("guided", 1), (" Dynamic ", 0), ("split", 2)):
        monkeypatch.setenv("SPECFLEET_SCHEDULE", text)
        assert native_backend.schedule_setting("avx2", "GenuineIntel", 6) == want
    _each_refused(monkeypatch, "SPECFLEET_SCHEDULE", native_backend.schedule_setting,
                  "static", "1", "guided,1")
    lib = native_backend.library()
    if lib is None:
        pytest.skip("no native kernels here")
    before = native_backend.tuning()
    threads = torch.get_num_threads()
    torch.manual_seed(6)
    w = random_blocks(T.Q4_K, 1000, 512, seed=6)  # 16 chunks of 64 rows: guided runs of 8, 4, 2, 1, 1 on 2 threads
    w0 = random_blocks(T.Q4_0, 700, 512, seed=7)
    parts = [(w, None), (w0, None)]
    arr = fused_parts(parts)
    x = torch.randn(5, 512)

    def fused(m):
        return run_fused(lib, arr, 2, 512, x[:m], torch.empty(m, 1700))

    try:
        torch.set_num_threads(2)
        lib.specfleet_set_chunk_bytes(0)
        lib.specfleet_set_schedule(0)
        want = [run_qlinear(lib, x[:m], w) for m in (1, 5)] + [fused(m) for m in (1, 5)]
        for mode, name in ((1, "guided"), (2, "split")):  # split: runs of equal bytes cut across the two parts
            for chunk in (0, 65536):
                for nt in (2, 3):
                    torch.set_num_threads(nt)
                    lib.specfleet_set_chunk_bytes(chunk)
                    lib.specfleet_set_schedule(mode)
                    assert native_backend.tuning()["schedule"] == name
                    got = [run_qlinear(lib, x[:m], w) for m in (1, 5)] + [fused(m) for m in (1, 5)]
                    for g, e in zip(got, want):
                        assert torch.equal(g, e), (name, chunk, nt)
        monkeypatch.setenv("SPECFLEET_SCHEDULE", "oops")
        assert native_backend._load(native_backend.isa()) is not None
        assert "keeping the compiled schedule" in caplog.text
    finally:
        torch.set_num_threads(threads)
        lib.specfleet_set_chunk_bytes(before["chunk_bytes"])
        lib.specfleet_set_schedule(native_backend.SCHEDULES[before["schedule"]])


def test_weight_row_groups_by_cpu_and_override(monkeypatch, caplog):
    """From how many activation rows weight rows go in pairs and fours, and past how many bytes of activations from 2
    rows (speed only; the bits are checked all ways above): the compiled 2 and never unless GROUP_ROWS names the
    path, vendor and family (a Zen 4: 8, and 2 past 16 KB) or SPECFLEET_GROUP_ROWS overrides; a malformed override
    is named and ignored, and the kernels still load."""
    monkeypatch.delenv("SPECFLEET_GROUP_ROWS", raising=False)
    assert native_backend.group_rows_setting("avx512vnni", "AuthenticAMD", 25) == (8, 16384)
    assert native_backend.group_rows_setting("avx512vnni", "AuthenticAMD", 26) is None
    assert native_backend.group_rows_setting("avx512vnni", "GenuineIntel", 6) is None
    assert native_backend.group_rows_setting("avx2", "AuthenticAMD", 25) is None
    monkeypatch.setenv("SPECFLEET_GROUP_ROWS", "9")
    assert native_backend.group_rows_setting("avx2", "GenuineIntel", 6) == (9, -1)  # the bytes kept
    monkeypatch.setenv("SPECFLEET_GROUP_ROWS", "9,4096")
    assert native_backend.group_rows_setting("avx2", "GenuineIntel", 6) == (9, 4096)
    _each_refused(monkeypatch, "SPECFLEET_GROUP_ROWS", native_backend.group_rows_setting,
                  "x", "1", "4,-5", "4,5,6", str(1 << 21))
    paths = [p for p in native_backend.runnable_isas() if native_backend.FAMILY[p] == "x86"]
    if not paths:
        pytest.skip("no x86 kernel path runs here")
    before = native_backend.tuning(paths[0])
    lib = native_backend.library(paths[0])
    try:
        monkeypatch.setenv("SPECFLEET_GROUP_ROWS", "11")
        native_backend._load(paths[0])
        assert native_backend.tuning(paths[0])["group_min_rows"] == 11
        monkeypatch.setenv("SPECFLEET_GROUP_ROWS", "oops")
        assert native_backend._load(paths[0]) is not None
        assert "keeping the compiled grouping" in caplog.text and native_backend.tuning(paths[0])["group_min_rows"] == 11
        lib.specfleet_set_grouping(0, 777)  # below 2 means 2
        assert native_backend.tuning(paths[0])["group_min_rows"] == 2
        assert native_backend.tuning(paths[0])["group_act_bytes"] == 777
        lib.specfleet_set_grouping(3, -1)  # negative bytes keep theirs
        assert native_backend.tuning(paths[0])["group_act_bytes"] == 777
    finally:
        lib.specfleet_set_grouping(before["group_min_rows"], before["group_act_bytes"])
