"""The ARM kernels (csrc/arch/arm/: NEON + the dot product) on this x86 machine: cross-built with Debian's
gcc-aarch64-linux-gnu and run under qemu-user through a C driver (tests/runtime/backends/native/csrc/sf_driver.c), once linked with
the ARM bodies and once with the generic bodies (both aarch64).

Contract (csrc/q_common.h): the ARM path gives the generic path's bits for every format, every tail, every row
count, every attention length and thread count (the integer sums are exact and each fp32 lane takes the
generic body's operations in its order, so "where the contract allows" is everywhere except NaN inputs), and
the generic path's aarch64 bits are the x86 build's (the same C). Independently of that, every result is
within the format's bound of a float64 reference, and a tiny decoder layer's verification rows (2 to 17) equal
their decode steps. The selection logic (an aarch64 Linux machine with `asimddp` picks `neondot`) is checked
without building. Skips with the reason when the cross toolchain or qemu is missing
(`apt-get install -y gcc-aarch64-linux-gnu qemu-user-static`)."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from specfleet.runtime.backends.native import build as native
from specfleet.runtime.backends.native import kernels as native_backend
from specfleet.runtime.formats import qtensor
from specfleet.runtime.formats.qtensor import quantize_activations
from tests.runtime.backends.native.test_qkernels import FORMATS, block_of, dense64, random_blocks

CROSS = shutil.which(os.environ.get("SPECFLEET_ARM_CC", "aarch64-linux-gnu-gcc"))
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
SYSROOT = "/usr/aarch64-linux-gnu"
DRIVER = Path(__file__).parent / "csrc" / "sf_driver.c"
LINEAR, ATTEND, ROPE, LAYER, FUSED = 1, 2, 3, 4, 5

pytestmark = pytest.mark.skipif(
    CROSS is None or QEMU is None,
    reason=f"needs an aarch64 cross compiler ({'found' if CROSS else 'missing'}) and qemu-user "
           f"({'found' if QEMU else 'missing'}): apt-get install -y gcc-aarch64-linux-gnu qemu-user-static")


def _build(family: str, out: Path) -> Path:
    srcs = native_backend.DRIVERS + native_backend.BODIES[family] + [DRIVER]
    cmd = [CROSS, "-O3", "-ffp-contract=off", "-fopenmp", "-std=c11", "-march=armv8.2-a+dotprod", "-static",
           f"-I{native_backend._CSRC}", *map(str, srcs), "-lm", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def exes(tmp_path_factory):
    d = tmp_path_factory.mktemp("arm")
    return {fam: _build(fam, d / f"sf_driver_{fam}") for fam in ("arm", "generic")}


class Records:
    """Records for sf_driver.c, run by both aarch64 builds; `run` returns each build's outputs."""

    def __init__(self):
        self.buf = bytearray()
        self.n = 0

    def add(self, cmd: int, params, arrays) -> int:
        self.buf += struct.pack("<qq", cmd, len(params)) + struct.pack(f"<{len(params)}q", *params)
        self.buf += struct.pack("<q", len(arrays))
        for a in arrays:
            b = np.ascontiguousarray(a).tobytes() if a is not None else b""
            self.buf += struct.pack("<q", len(b)) + b
        self.n += 1
        return self.n - 1

    def run(self, exes, tmp_path) -> dict[str, list[list[bytes]]]:
        src = tmp_path / "records.bin"
        src.write_bytes(bytes(self.buf))
        outs = {}
        for fam, exe in exes.items():
            dst = tmp_path / f"out-{fam}.bin"
            proc = subprocess.run([QEMU, "-L", SYSROOT, str(exe), str(src), str(dst)], capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, f"{fam}: {proc.stderr[-2000:]}"
            data, pos, recs = dst.read_bytes(), 0, []
            while pos < len(data):
                (na,), pos = struct.unpack_from("<q", data, pos), pos + 8
                arrs = []
                for _ in range(na):
                    (nb,), pos = struct.unpack_from("<q", data, pos), pos + 8
                    arrs.append(data[pos:pos + nb])
                    pos += nb
                recs.append(arrs)
            assert len(recs) == self.n, fam
            outs[fam] = recs
        return outs


def f32(b: bytes, *shape) -> np.ndarray:
    return np.frombuffer(b, dtype=np.float32).reshape(shape)


def fbits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


def same_bits(outs, i: int) -> None:
    """Record i's outputs are byte for byte the same from the ARM and the generic build."""
    for j, (a, g) in enumerate(zip(outs["arm"][i], outs["generic"][i])):
        if a != g:
            fa, fg = np.frombuffer(a, np.float32), np.frombuffer(g, np.float32)
            bad = np.nonzero(fa.view(np.int32) != fg.view(np.int32))[0]
            raise AssertionError(f"record {i} output {j}: {len(bad)} of {len(fa)} values differ from the generic "
                                 f"path, first at {bad[0]}: arm {fa[bad[0]]!r} generic {fg[bad[0]]!r}")


def test_an_aarch64_linux_cpu_with_the_dot_product_selects_the_arm_path(monkeypatch):
    """Without building: the loader's choice on a simulated aarch64 Linux machine (an ARM without
    `asimddp` is tests/runtime/formats/test_gguf_native.py's: it runs dense and says why)."""
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(native, "_cpu_flags", frozenset({"fp", "asimd", "asimddp", "crc32"}))
    assert native_backend.runnable_isas() == ["neondot"] and native_backend.isa() == "neondot"
    assert native_backend.flags("neondot")[-2:] == ["-march=armv8.2-a+dotprod", "-lm"]
    assert all("arch/arm" in str(p) or "generic" in str(p) or p in native_backend.DRIVERS
               for p in native_backend.sources("neondot"))
    monkeypatch.setattr(native, "_cpu_flags", frozenset({"fp", "asimd"}))
    assert native_backend.runnable_isas() == [] and "dot product" in native_backend.missing()
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert "Linux only" in native_backend.missing()


def test_linear_every_format_tail_and_row_count(exes, tmp_path):
    """Every format, K of one and several blocks, N across a scheduled chunk (70 = 64 + a tail), M from 1
    to 17 (each row-tile tail and two tiles), 1 to 3 threads: ARM = generic bits, every row the same
    whatever M and the threads, the x86 generic library's bits too, and float64 within the format's bound."""
    x86 = native_backend.library("generic")
    assert x86 is not None, native_backend._reasons
    recs, cases = Records(), []
    for qt in FORMATS:
        # 32-weight formats: one block, a short group, one group of eight and a tail of four (12 = 384), and
        # three of eight and one of four (28 = 896, the 0.5B's width)
        for kb in ((1, 3) if block_of(qt) == 256 else (1, 3, 12, 28)):
            k, n = kb * block_of(qt), 70
            w = random_blocks(qt, n, k, seed=kb + int(qt))
            g = torch.Generator().manual_seed(int(qt) * 10 + kb)
            x = (torch.randn(17, k, generator=g) * torch.logspace(-2, 1, k)).contiguous()
            ids = [recs.add(LINEAR, [int(qt), n, k, m, w.data.shape[1], 1 + m % 3], [w.data.numpy(), x[:m].numpy()])
                   for m in range(1, 18)]
            cases.append((qt, w, x, ids))
    outs = recs.run(exes, tmp_path)
    for qt, w, x, ids in cases:
        n, k = w.shape
        full = f32(outs["arm"][ids[-1]][0], 17, n)
        wd = dense64(w)
        xq = quantize_activations(x, qt).double()
        tight = xq @ wd.t()
        assert ((torch.from_numpy(full.astype(np.float64)) - tight).abs()
                <= 2e-6 * (xq.abs() @ wd.abs().t()) + 1e-30).all(), qt.name
        assert np.array_equal(full, qtensor.run_qlinear(x86, x, w).numpy()), f"{qt.name}: x86 generic differs"
        for m, i in enumerate(ids, start=1):
            same_bits(outs, i)
            assert np.array_equal(f32(outs["arm"][i][0], m, n), full[:m]), f"{qt.name} k={k} rows={m}"


def _attention_reference(q, k, v, plan_arrays, scale):
    slots, base, plen, xoff, nkeys, extras = plan_arrays
    out = np.zeros(q.shape, dtype=np.float64)
    heads, kvh = q.shape[1], k.shape[1]
    for i in range(q.shape[0]):
        keys = [slots[base[i] + (j if j < plen[i] else extras[xoff[i] + j - plen[i]])] for j in range(nkeys[i])]
        for h in range(heads):
            g = h // (heads // kvh)
            s = (k[keys, g].astype(np.float64) @ q[i, h].astype(np.float64)) * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[keys, g].astype(np.float64)
    return out


@pytest.mark.parametrize("heads,kv_heads,d", [(12, 2, 128), (14, 2, 64), (4, 4, 32), (7, 1, 96)])
def test_attention_every_length_and_thread_count(exes, tmp_path, heads, kv_heads, d):
    """Lengths around the 4-, 8- and 16-key chunks, prefix rows and a tree row over gathered keys, 1 to 3
    threads: ARM = generic bits = the x86 AVX2 library's bits; float64 within 1e-5 of the largest value."""
    from specfleet.runtime.model.attention import AttentionBatch, SeqAttention
    from specfleet.runtime.step.plan import KeyPlan, native_attend

    x86 = native_backend.library()
    g = torch.Generator().manual_seed(heads * d)
    recs, cases = Records(), []
    for t, length in enumerate((1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 25, 70, 130)):
        k = torch.randn(length + 3, kv_heads, d, generator=g)
        v = torch.randn(length + 3, kv_heads, d, generator=g)
        q = torch.randn(6, heads, d, generator=g) * 3
        tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)
        seqs = [SeqAttention(1, length - 1, slice(0, length)), SeqAttention(2, length + 1, slice(0, length + 3)),
                SeqAttention(3, length, slice(0, length + 3), new_mask=torch.from_numpy(tree), host_mask=tree)]
        batch = AttentionBatch(torch.zeros(6, dtype=torch.long), seqs)
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in KeyPlan.build(batch).arrays()]
        arrays = [a if a.size else np.zeros(1, np.int64) for a in arrays]
        i = recs.add(ATTEND, [6, heads, kv_heads, d, 1 + t % 3, fbits(d ** -0.5)],
                     [q.numpy(), k.numpy(), v.numpy(), *arrays])
        cases.append((i, q, k, v, batch, arrays))
    outs = recs.run(exes, tmp_path)
    for i, q, k, v, batch, arrays in cases:
        same_bits(outs, i)
        got = f32(outs["arm"][i][0], *q.shape)
        if x86 is not None:
            assert np.array_equal(got, native_attend(x86, q, k, v, batch, d ** -0.5).numpy()), f"record {i}: x86"
        ref = _attention_reference(q.numpy(), k.numpy(), v.numpy(), arrays, d ** -0.5)
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), f"record {i}"


def test_rotary_and_fused_products_with_norms_and_silu(exes, tmp_path):
    """Rotary (head sizes with and without a 4-lane tail), and every format behind RMSNorm, SiLU * up (a
    residual add) and no transform, at row counts 1 to 17: ARM = generic bits, row counts agree, float64
    within bound for the transforms (the product's bound is the linear test's)."""
    recs, rope_cases, fused_cases = Records(), [], []
    for d in (128, 64, 32, 12, 6):
        heads, kvh, t, ns = 6, 2, 5, 12
        g = torch.Generator().manual_seed(d)
        qkv = torch.randn(t, (heads + 2 * kvh) * d, generator=g)
        cos, sin = torch.randn(64, d, generator=g), torch.randn(64, d, generator=g)
        pos, slots = np.array([3, 7, 8, 20, 63]), np.array([9, 0, 4, 5, 11])
        i = recs.add(ROPE, [t, heads, kvh, d, ns], [qkv.numpy(), pos, cos.numpy(), sin.numpy(), slots])
        rope_cases.append((i, d, qkv, cos, sin, pos, slots, heads, kvh, t, ns))
    for qt in FORMATS:
        k = 2 * 256 + (0 if qt in (T.Q4_K, T.Q6_K) else 96)  # 608 for the 32-weight formats: a 32-lane tail
        n = 19
        w = random_blocks(qt, n, k, seed=int(qt))
        bias = torch.randn(n)
        g = torch.Generator().manual_seed(int(qt))
        for pre in (0, 1, 2):
            x = torch.randn(17, (2 if pre == 2 else 1) * k, generator=g) * 2
            nw = torch.rand(k, generator=g) + 0.5
            for m in (1, 2, 8, 9, 17):
                y0 = torch.ones(m, n)
                i = recs.add(FUSED, [k, m, pre, int(pre == 2), 1 + m % 2, fbits(1e-6), int(qt), n, w.data.shape[1]],
                             [w.data.numpy(), bias.numpy() if pre != 2 else None, x[:m].numpy(),
                              nw.numpy() if pre == 1 else None, y0.numpy()])
                fused_cases.append((i, qt, pre, m, n, k, w, bias, x, nw))
    outs = recs.run(exes, tmp_path)
    for i, d, qkv, cos, sin, pos, slots, heads, kvh, t, ns in rope_cases:
        same_bits(outs, i)
        q = f32(outs["arm"][i][0], t, heads, d)
        half = d // 2
        x = qkv.numpy().reshape(t, heads + 2 * kvh, d)[:, :heads].astype(np.float64)
        c, s = cos.numpy()[pos][:, None].astype(np.float64), sin.numpy()[pos][:, None].astype(np.float64)
        ref = x * c + np.concatenate([-x[..., half:], x[..., :half]], -1) * s
        assert np.abs(q - ref).max() <= 1e-5 * np.abs(ref).max(), d
    full = {}
    for i, qt, pre, m, n, k, w, bias, x, nw in fused_cases:
        same_bits(outs, i)
        y = f32(outs["arm"][i][0], m, n)
        if m == 17:
            full[(qt, pre)] = y
            x64 = x.double()
            if pre == 1:
                a = nw.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
            elif pre == 2:
                a = torch.nn.functional.silu(x64[:, :k]) * x64[:, k:]
            else:
                a = x64
            xq = quantize_activations(a.float(), qt).double()
            ref = xq @ dense64(w).t() + (1.0 if pre == 2 else bias.double())
            # the transform in fp32 may move a value across an int8 step: a loose bound on top of the tight one
            bound = 0.02 * (a.abs() @ dense64(w).abs().t()) + 1e-5
            assert ((torch.from_numpy(y.astype(np.float64)) - ref).abs() <= bound).all(), (qt.name, pre)
    for i, qt, pre, m, n, k, w, bias, x, nw in fused_cases:
        assert np.array_equal(f32(outs["arm"][i][0], m, n), full[(qt, pre)][:m]), (qt.name, pre, m)


LAYER_FORMATS = {"k": (T.Q4_K, T.Q8_0, T.Q4_K, T.Q6_K), "legacy": (T.Q5_0, T.Q4_0, T.Q4_1, T.Q8_0)}


@pytest.mark.parametrize("formats", list(LAYER_FORMATS), ids=list(LAYER_FORMATS))
def test_a_decoder_layer_verification_rows_equal_their_decode_steps(exes, tmp_path, formats):
    """A tiny decoder layer (hidden 256, 4 query heads over 2 KV heads of 32, MLP 512; weights quantized here
    by runtime/formats/qtensor.py `quantize`) through the whole layer loop (RMSNorm, q/k/v with bias, rotary,
    cache write, attention, o + residual, RMSNorm, gate/up, SiLU * up, down + residual): a 5-token prompt,
    then 17 decode steps one row at a time, and verification steps of 2 to 17 rows from the prompt's cache.
    Each record gives the generic path's bits on ARM; each verification row equals its decode step, and so
    do the cache rows it wrote."""
    hidden, inter, heads, kvh, d, prompt, ns = 256, 512, 4, 2, 32, 5, 32
    wq = (heads + 2 * kvh) * d
    g = torch.Generator().manual_seed(7 if formats == "k" else 8)
    tq, to, tgu, td = LAYER_FORMATS[formats]
    # quantized from random dense weights (Q6_K, which runtime/formats has no quantizer for: valid random blocks)
    ws = [qtensor.quantize(torch.randn(n, kk, generator=g) * 0.05, t) if t != T.Q6_K else random_blocks(t, n, kk, seed=n)
          for (n, kk, t) in ((wq, hidden, tq), (hidden, heads * d, to), (2 * inter, hidden, tgu), (hidden, inter, td))]
    bqkv = torch.randn(wq, generator=g) * 0.1
    norm1, norm2 = torch.rand(hidden, generator=g) + 0.5, torch.rand(hidden, generator=g) + 0.5
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(64).float(), inv)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).contiguous(), torch.cat([ang.sin(), ang.sin()], -1).contiguous()
    hs = torch.randn(prompt + 17, hidden, generator=g)
    kslots = np.arange(ns, dtype=np.int64)
    none = np.zeros(1, np.int64)

    def layer(rows, first, cache_from, threads):
        t = len(rows)
        pos = np.arange(first, first + t, dtype=np.int64)
        nkeys = pos + 1
        return recs.add(LAYER, [t, hidden, inter, heads, kvh, d, threads, fbits(d ** -0.5), fbits(1e-6), ns, cache_from,
                                int(tq), int(to), int(tgu), int(td)],
                        [ws[0].data.numpy(), bqkv.numpy(), ws[1].data.numpy(), ws[2].data.numpy(), ws[3].data.numpy(),
                         norm1.numpy(), norm2.numpy(), hs[rows].numpy(), pos, cos.numpy(), sin.numpy(), pos, kslots,
                         np.zeros(t, np.int64), nkeys, np.zeros(t, np.int64), nkeys, none])

    recs = Records()
    pre = layer(list(range(prompt)), 0, -1, 2)
    steps, prev = [], pre
    for s in range(17):
        prev = layer([prompt + s], prompt + s, prev, 1 + s % 3)
        steps.append(prev)
    verify = {n: layer(list(range(prompt, prompt + n)), prompt, pre, 1 + n % 3) for n in range(2, 18)}
    outs = recs.run(exes, tmp_path)
    for i in range(recs.n):
        same_bits(outs, i)
    arm = outs["arm"]
    cache_row = kvh * d
    for n, i in verify.items():
        h = f32(arm[i][0], n, hidden)
        kc, vc = f32(arm[i][1], ns, cache_row), f32(arm[i][2], ns, cache_row)
        for r in range(n):
            step = steps[r]
            assert np.array_equal(h[r], f32(arm[step][0], 1, hidden)[0]), f"{n} rows: row {r} differs from its decode step"
            p = prompt + r
            assert np.array_equal(kc[p], f32(arm[step][1], ns, cache_row)[p]) and np.array_equal(
                vc[p], f32(arm[step][2], ns, cache_row)[p]), f"{n} rows: cache row {p}"
    # and the layer did something: h moved from its input by the attention and MLP residuals
    assert not np.array_equal(f32(arm[steps[0]][0], 1, hidden)[0], hs[prompt].numpy())


if __name__ == "__main__":  # a quick manual run
    sys.exit(pytest.main([__file__, "-q"]))
