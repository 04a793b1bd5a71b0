"""Weights kept in a GGUF block format, and their products: the Python side of csrc/q_*.c.

A `QTensor` is a 2-D weight [N, K] (N output rows, K inputs) stored as llama.cpp stores it: each row
is K / block_size blocks of `type_size` bytes (the layouts are written out at the top of
csrc/q_legacy.c and csrc/q_kquants.c). The 32-weight formats' bytes can wrap the GGUF file's read-only
memory map; Q4_K and Q6_K are copied once with each block's quants re-ordered for the kernels
(`pack_k`: same block size, scales where they were; `gguf_bytes()` gives the file's order back). Either
way a model loaded like this costs about the file's size in memory.

`qlinear(x, w)` computes x @ W^T with the native kernel (AVX2 + FMA + F16C + OpenMP, compiled on first
use into the cache by runtime/native.py and loaded with ctypes, which releases the GIL). The kernel
quantizes each row of x to int8 on its own and sums in a fixed order, so a row's result is bit for
bit the same whatever other rows share the call: verifying k+1 drafted tokens gives each of them
what decoding it alone gives, which keeps speculation lossless on these weights. Where the kernel
cannot be built, `available()` is False, `unavailable_reason()` says why, and `qlinear` falls back
to dequantizing (slow, for tests and odd machines; the model loader prefers dense weights then). The
same kernel serves every row count (decode, verification, prefill), so batch invariance holds for
every batch composition; there is no BLAS route above some M.

Formats: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K (`SUPPORTED_TYPES`). F32/F16/BF16 matrices are not
QTensors: callers keep them dense. `quantize` writes Q4_0, Q4_1, Q5_0 and Q8_0 through gguf-py's
quantizers and Q4_K through our own (gguf-py has none for it).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES

from specfleet.runtime import kquant_order, native
from specfleet.runtime.kquant_order import unpack as unpack_k

log = logging.getLogger(__name__)

SUPPORTED_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K})
K_TYPES = frozenset({T.Q4_K, T.Q6_K})  # 256-weight super-blocks
FALLBACK_ROWS = 4096  # weight rows the fallback dequantizes at a time
_CSRC = Path(__file__).with_name("csrc")
# linked into one library; q_fused.c holds the fused per-layer calls of native models (runtime/model.py)
SOURCES = [_CSRC / "q_linear.c", _CSRC / "q_legacy.c", _CSRC / "q_kquants.c", _CSRC / "q_fused.c"]
HEADERS = (_CSRC / "q_common.h",)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# The kernels' ISA paths, best first: the CPU flags each needs and what it adds to FLAGS. One library is
# built per path (csrc/q_common.h picks the instructions from the compiler's macros); every path gives
# the AVX2 path's bits (tests/test_isa_paths.py), so the choice changes speed only. Per-path flags rather
# than -march=native: the build is the same on every machine with those flags, so its bits are too, and
# a test can build and compare each path the CPU runs.
ISA_PATHS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512vnni": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                   ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
    "avxvnni": (("avx_vnni",), ("-mavxvnni",)),
    "avx2": ((), ()),
}
ABI = 5  # 3: the K formats in the kernels' interleaved order (pack_k); 4: attention reads a key plan; 5: ISA paths
# input transforms of `run_fused` (csrc/q_fused.c): none, RMSNorm with a weight, SiLU(gate) * up
PRE_NONE, PRE_RMSNORM, PRE_SILU_MUL = 0, 1, 2


class FusedPart(ctypes.Structure):
    """One weight of a fused product (csrc/q_fused.c's sfq_part)."""

    _fields_ = [("type", ctypes.c_int64), ("W", ctypes.c_void_p), ("row_bytes", ctypes.c_int64),
                ("N", ctypes.c_int64), ("bias", ctypes.c_void_p)]

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}  # per ISA path, once tried (None: unavailable, see _reasons)
_reasons: dict[str, str] = {}


class NativeLayer(ctypes.Structure):
    """One decoder layer for `specfleet_decode_layers` (csrc/q_fused.c's sfq_layer)."""

    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("n_qkv", ctypes.c_int64), ("n_o", ctypes.c_int64), ("n_gate_up", ctypes.c_int64),
                ("n_down", ctypes.c_int64), ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p),
                ("eps1", ctypes.c_double), ("eps2", ctypes.c_double), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p)]


def _missing() -> str | None:
    reason = native.missing_prerequisite()
    if reason is None and "f16c" not in native.cpu_flags():
        reason = "this CPU lacks F16C"
    return reason


def runnable_isas() -> list[str]:
    """The ISA paths this CPU can run, best first (empty where the kernels cannot run at all)."""
    if _missing() is not None:
        return []
    have = native.cpu_flags()
    return [name for name, (needs, _) in ISA_PATHS.items() if set(needs) <= have]


def isa() -> str | None:
    """The ISA path the kernels use here: the best the CPU runs, or SPECFLEET_ISA (read once per process,
    like SPECFLEET_NATIVE) to pin a slower one; None where no path runs."""
    wanted = os.environ.get("SPECFLEET_ISA", "").strip().lower()
    paths = runnable_isas()
    if wanted:
        if wanted not in ISA_PATHS:
            raise ValueError(f"SPECFLEET_ISA={wanted!r} is not a kernel path; choose one of {list(ISA_PATHS)}")
        if wanted not in paths:
            raise ValueError(f"SPECFLEET_ISA={wanted!r}: this CPU cannot run it (it runs {paths or 'none'})")
        return wanted
    return paths[0] if paths else None


def _load(path: str) -> ctypes.CDLL:
    missing = _missing()
    if missing is not None:
        raise RuntimeError(missing)
    if path not in runnable_isas():
        raise RuntimeError(f"this CPU cannot run the {path} kernels")
    lib = native.compile_library(SOURCES, FLAGS + list(ISA_PATHS[path][1]), HEADERS)
    if lib.specfleet_q_abi() != ABI:
        raise RuntimeError(f"{lib._name} has ABI {lib.specfleet_q_abi()}, expected {ABI}")
    lib.specfleet_q_isa.restype = ctypes.c_char_p
    if lib.specfleet_q_isa().decode() != path:
        raise RuntimeError(f"{lib._name} was built for {lib.specfleet_q_isa().decode()}, expected {path}")
    fn = lib.specfleet_q_linear
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.specfleet_q_act_row_bytes.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.specfleet_q_act_row_bytes.restype = ctypes.c_int64
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.specfleet_q_linear_fused.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, i64, i64, i64]
    lib.specfleet_q_linear_fused.restype = ctypes.c_int
    lib.specfleet_rope_kv.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.specfleet_rope_kv.restype = None
    lib.specfleet_attend.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_float,
                                     ptr, i64]
    lib.specfleet_attend.restype = ctypes.c_int
    lib.specfleet_decode_layers.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr,
                                            ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, i64]
    lib.specfleet_decode_layers.restype = ctypes.c_int
    lib.specfleet_k_pack.argtypes = [ctypes.c_int, ptr, ptr, i64, ctypes.c_int]
    lib.specfleet_k_pack.restype = ctypes.c_int
    return lib


def _get(path: str | None = None) -> ctypes.CDLL | None:
    """The kernel library of ISA path `path` (default: `isa()`), built on first use; None where it cannot
    be (the reason in `unavailable_reason()`)."""
    if path is None:
        if _libs.get("default") is not None:  # the hot path: every native forward asks
            return _libs["default"]
        try:
            path = isa()
        except ValueError as e:
            path = "?"
            _reasons.setdefault(path, str(e))
        if path is None:
            path = "avx2"  # _load says why nothing runs
        lib = _get(path)
        if lib is not None:
            _libs["default"] = lib
        return lib
    if path in _libs:
        return _libs[path]
    with _lock:
        if path not in _libs:
            try:
                _libs[path] = _load(path) if path != "?" else None
            except Exception as e:  # noqa: BLE001 -- any failure means: no native kernel here
                _reasons[path] = str(e)
                _libs[path] = None
                log.warning("specfleet native GGUF kernels (%s) unavailable: %s", path, e)
    return _libs[path]


def available() -> bool:
    return _get() is not None


def unavailable_reason() -> str | None:
    if _get() is not None:
        return None
    return next(iter(_reasons.values()), None)


def _as_type(qtype) -> T:
    try:
        return T(int(qtype))
    except ValueError as e:
        raise ValueError(f"{qtype!r} is not a GGML quantization type") from e


class QTensor:
    """A [N, K] weight in one GGUF block format: `data` uint8 [N, row_bytes], `qtype`, `shape`."""

    __slots__ = ("data", "qtype", "shape")

    def __init__(self, data, qtype, shape: tuple[int, int], packed: bool = False):
        """`data`: the rows in the file's (ggml's) order; a Q4_K / Q6_K matrix is copied into the
        kernels' order (`pack_k`), the other formats are wrapped without a copy where they are
        contiguous. `packed=True` says a K-format `data` is in the kernels' order already."""
        qtype = _as_type(qtype)
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(f"{qtype.name} is not a supported block format; supported: "
                             f"{sorted(t.name for t in SUPPORTED_TYPES)}")
        n, k = (int(v) for v in shape)
        block, size = GGML_QUANT_SIZES[qtype]
        if k % block:
            raise ValueError(f"{qtype.name} needs K to be a multiple of {block}, got shape {(n, k)}")
        row_bytes = k // block * size
        if isinstance(data, np.ndarray):
            with warnings.catch_warnings():  # a read-only memory map is fine: nothing writes to it
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(data.view(np.uint8))
        if data.dtype != torch.uint8 or data.numel() != n * row_bytes:
            raise ValueError(f"{qtype.name} [{n}, {k}] needs {n * row_bytes} bytes, got {data.numel()} "
                             f"of {data.dtype}")
        data = data.reshape(n, row_bytes)
        if qtype in K_TYPES and not packed:
            data = torch.from_numpy(pack_k(data.numpy(), qtype))
        self.data = data.contiguous()  # the kernels read rows back to back
        self.qtype = qtype
        self.shape = (n, k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __repr__(self) -> str:
        return f"QTensor({self.qtype.name}, shape={self.shape})"

    def gguf_bytes(self) -> np.ndarray:
        """uint8 [N, row_bytes] in the file's (ggml's) block order, as gguf-py reads and writes it."""
        raw = self.data.numpy()
        return unpack_k(raw, self.qtype) if self.qtype in K_TYPES else raw

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _dequantize(self.data, self.qtype, self.shape[1]).to(dtype)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [len(ids), K]: only the rows asked for (an embedding lookup)."""
        return _dequantize(self._gather(ids), self.qtype, self.shape[1])

    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        """uint8 [len(ids), row_bytes], a copy. numpy's gather: torch's row indexing of a wide uint8
        matrix took ~11 ms for 9-128 rows of the 1.5B's embedding here, numpy's takes ~25 us."""
        return torch.from_numpy(self.data.numpy()[ids.reshape(-1).to(torch.long).numpy()])

    def select_rows(self, index) -> "QTensor":
        """The rows `index` picks (a slice, or a sequence / LongTensor of row ids, repeats allowed) as a new
        QTensor, e.g. to un-permute q/k or keep the first V rows of an output head."""
        if isinstance(index, slice):
            index = torch.arange(self.shape[0])[index]
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        if index.numel() and (int(index.min()) < -self.shape[0] or int(index.max()) >= self.shape[0]):
            raise IndexError(f"select_rows: row ids must lie in [0, {self.shape[0]}) for {self!r}")
        return QTensor(self._gather(index), self.qtype, (int(index.numel()), self.shape[1]), packed=True)

    @staticmethod
    def cat(parts: list["QTensor"]) -> "QTensor":
        """Rows of `parts` one after another (fusing q/k/v or gate/up): all must share qtype and K."""
        if not parts:
            raise ValueError("QTensor.cat needs at least one QTensor")
        first = parts[0]
        for p in parts[1:]:
            if p.qtype != first.qtype or p.shape[1] != first.shape[1]:
                raise ValueError(f"cannot concatenate {first!r} with {p!r}: formats and K must match")
        return QTensor(torch.cat([p.data for p in parts]), first.qtype, (sum(p.shape[0] for p in parts), first.shape[1]),
                       packed=True)


def _dequantize(data: torch.Tensor, qtype: T, k: int) -> torch.Tensor:
    """fp32 [rows, k] from a QTensor's bytes (the kernels' order for the K formats)."""
    from gguf.quants import dequantize

    raw = data.contiguous().numpy()
    arr = dequantize(unpack_k(raw, qtype) if qtype in K_TYPES else raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(data.shape[0], k))


def qlinear(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x fp32 [M, K] @ w^T (+ bias) -> fp32 [M, N].

    With the native kernel a row's result is bit for bit the same whatever other rows share the call
    and whatever the thread count. The fallback computes the same quantity (x rounded through the
    kernel's per-block int8, `quantize_activations`, times the dequantized weight) with torch, equal
    to the kernel's up to fp32 rounding; it dequantizes FALLBACK_ROWS weight rows at a time and keeps
    nothing."""
    if not isinstance(w, QTensor):
        raise TypeError(f"qlinear needs a QTensor weight, got {type(w).__name__}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != w.shape[1] or x.device.type != "cpu":
        raise ValueError(f"qlinear needs fp32 CPU x of shape [M, {w.shape[1]}], got {x.dtype} {tuple(x.shape)} "
                         f"on {x.device}")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"qlinear: bias of shape {tuple(bias.shape)} does not match {w!r}")
    lib = _get()
    if lib is None:
        xq = quantize_activations(x, w.qtype)
        y = torch.cat([xq @ _dequantize(w.data[n0:n0 + FALLBACK_ROWS], w.qtype, w.shape[1]).t()
                       for n0 in range(0, w.shape[0], FALLBACK_ROWS)], dim=1) if w.shape[0] else x.new_zeros(len(x), 0)
    else:
        y = run_qlinear(lib, x, w)
    if bias is not None:
        y += bias.float()
    return y


def quantize_activations(x: torch.Tensor, qtype) -> torch.Tensor:
    """x fp32 [M, K] as the kernel sees it: each block of 32 values (256 for the K formats) rounded to
    int8 with scale amax / 127 (round half to even), returned dequantized in fp32."""
    block = 256 if _as_type(qtype) in K_TYPES else 32
    xb = x.float().reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(x.shape)


def run_qlinear(lib: ctypes.CDLL, x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """The kernel call without checks (`qlinear` makes them): x fp32 [M, K] on the CPU."""
    x = x.contiguous()
    m = x.shape[0]
    n, k = w.shape
    y = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        act = torch.empty(m * lib.specfleet_q_act_row_bytes(int(w.qtype), k), dtype=torch.uint8)
        rc = lib.specfleet_q_linear(int(w.qtype), w.data.data_ptr(), w.data.shape[1], n, k, x.data_ptr(), m,
                                    y.data_ptr(), act.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the native kernel refused {w!r}")
    return y


def fused_parts(parts: list[tuple[QTensor, torch.Tensor | None]]):
    """The ctypes array `run_fused` takes for weights (with optional fp32 contiguous biases) sharing an
    input; it points into their storage, so the caller keeps `parts` alive as long as the array."""
    arr = (FusedPart * len(parts))()
    for i, (w, b) in enumerate(parts):
        if b is not None and (b.dtype != torch.float32 or not b.is_contiguous() or tuple(b.shape) != (w.shape[0],)):
            raise ValueError(f"fused_parts: the bias of {w!r} must be contiguous fp32 of shape ({w.shape[0]},)")
        arr[i] = FusedPart(int(w.qtype), w.data.data_ptr(), w.data.shape[1], w.shape[0],
                           None if b is None else b.data_ptr())
    return arr


def run_fused(lib: ctypes.CDLL, parts, nparts: int, k: int, x: torch.Tensor, y: torch.Tensor, pre: int = PRE_NONE,
              pre_weight: torch.Tensor | None = None, eps: float = 0.0, accumulate: bool = False) -> torch.Tensor:
    """y[:, sum of parts' N] (=, or += with `accumulate`) pre(x) @ W^T (+ bias) for the weights of `parts`
    (`fused_parts`), side by side; without checks beyond the kernel's own. x fp32 [M, K] rows (or [M, 2K]:
    gate | up with PRE_SILU_MUL) with unit inner stride, y fp32 [M, *] likewise; pre_weight fp32 [K]
    contiguous with PRE_RMSNORM. Per row the same computation whatever M is (csrc/q_fused.c)."""
    m = x.shape[0]
    rc = lib.specfleet_q_linear_fused(parts, nparts, k, x.data_ptr(), x.stride(0), m, pre,
                                      None if pre_weight is None else pre_weight.data_ptr(), eps, y.data_ptr(),
                                      y.stride(0), int(accumulate), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the native fused kernel refused its arguments (code {rc})")
    return y


def quantize(weight: torch.Tensor, qtype) -> QTensor:
    """A dense [N, K] weight in block format `qtype` (Q4_0, Q4_1, Q5_0, Q8_0 or Q4_K)."""
    qtype = _as_type(qtype)
    if weight.dim() != 2:
        raise ValueError(f"quantize needs a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    arr = weight.detach().float().cpu().numpy()
    if qtype == T.Q4_K:
        data = _quantize_q4_k(arr)
    elif qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0):
        from gguf.quants import quantize as gguf_quantize

        block = GGML_QUANT_SIZES[qtype][0]
        if k % block:
            raise ValueError(f"{qtype.name} needs K to be a multiple of {block}, got shape {(n, k)}")
        data = gguf_quantize(arr, qtype)
    else:
        raise ValueError(f"cannot quantize to {qtype.name}; choose Q4_0, Q4_1, Q5_0, Q8_0 or Q4_K")
    return QTensor(np.ascontiguousarray(data).reshape(n, -1), qtype, (n, k))


def _quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K with per-sub-block min/max (w = d*sc*q - dmin*mn), 6-bit scales and mins relative to the
    super-block's largest; rows [N, K] with K a multiple of 256."""
    n, k = w.shape
    if k % 256:
        raise ValueError(f"Q4_K needs K to be a multiple of 256, got shape {(n, k)}")
    sub = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # the min term only ever subtracts
    hi = sub.max(axis=-1)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = scale.max(axis=-1) / 63.0
    dmin = mins.max(axis=-1) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d32, dmin32 = d16.astype(np.float32), dmin16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[..., None] > 0, np.rint(scale / d32[..., None]), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin32[..., None] > 0, np.rint(mins / dmin32[..., None]), 0).clip(0, 63).astype(np.uint8)
        step = d32[..., None] * sc
        off = dmin32[..., None] * mn
        q = np.where(step[..., None] > 0, np.rint((sub + off[..., None]) / step[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8)  # [n, nb, 8, 32]
    scales = np.zeros((n, k // 256, 12), dtype=np.uint8)
    scales[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    qs = (q[:, :, 0::2, :] | (q[:, :, 1::2, :] << 4)).reshape(n, k // 256, 128)  # low: sub 2c, high: 2c+1
    out = np.concatenate([d16.view(np.uint8).reshape(n, k // 256, 2), dmin16.view(np.uint8).reshape(n, k // 256, 2),
                          scales, qs], axis=-1)
    return out.reshape(n, -1)


def pack_k(data: np.ndarray, qtype, native: bool = True) -> np.ndarray:
    """Q4_K / Q6_K bytes (any shape, whole blocks) from ggml's order into the kernels' order; a copy.
    The C library does it where it is built (numpy's version, `native=False`, moves ~70 MB/s: a
    quarter of a minute for the 1.5B)."""
    qtype = _as_type(qtype)
    lib = _get() if native else None
    if lib is None:
        return kquant_order.pack(data, qtype)
    src = np.ascontiguousarray(data, dtype=np.uint8)
    out = np.empty_like(src)
    nblocks = src.size // GGML_QUANT_SIZES[qtype][1]
    if lib.specfleet_k_pack(int(qtype), src.ctypes.data, out.ctypes.data, nblocks, torch.get_num_threads()) != 0:
        raise ValueError(f"the native kernel cannot pack {qtype.name}")
    return out
