"""Weights kept in a GGUF block format, and their products: the Python side of the native kernels (runtime/backends/native/csrc/).

A `QTensor` is a 2-D weight [N, K] (N output rows, K inputs) stored as llama.cpp stores it: each row
is K / block_size blocks of `type_size` bytes (the layouts are written out in
csrc/q_common.h). Q4_1's bytes can wrap the GGUF file's read-only memory map; the other formats are
copied once with their quants re-ordered for the kernels (`pack_rows`, the same size: Q4_K and Q6_K
within each block, `pack_k`; Q4_0, Q5_0 and Q8_0 in groups of eight blocks, group32_order.py;
`gguf_bytes()` gives the file's order back). Either way a model loaded like this costs about the file's
size in memory.

`qlinear(x, w)` computes x @ W^T with the native kernel (runtime/backends/native/kernels.py: the library of the
CPU's ISA path, compiled on first use and loaded with ctypes, which releases the GIL). The kernel
quantizes each row of x to int8 on its own and sums in a fixed order, so a row's result is bit for
bit the same whatever other rows share the call: verifying k+1 drafted tokens gives each of them
what decoding it alone gives, which keeps speculation lossless on these weights. Where the kernel
cannot be built, `native_backend.available()` is False and says why, and `qlinear` falls back
to dequantizing (slow, for tests and odd machines; the model loader prefers dense weights then). The
same kernel serves every row count (decode, verification, prefill), so batch invariance holds for
every batch composition; there is no BLAS route above some M.

Formats: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K (`SUPPORTED_TYPES`). F32/F16/BF16 matrices are not
QTensors: callers keep them dense. `quantize` writes Q4_0, Q4_1, Q5_0 and Q8_0 through gguf-py's
quantizers and Q4_K through our own (gguf-py has none for it).
"""
from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES

from specfleet.runtime.formats import group32_order, kquant_order
from specfleet.runtime.backends.native.kernels import PRE_NONE, FusedPart, library
from specfleet.runtime.formats.kquant_order import unpack as unpack_k



@dataclass(frozen=True)
class BlockFormat:
    """What specfleet knows of one GGUF block format (ggml's type_traits, for the formats our kernels run).
    Every format has one C entry point, `specfleet_q_linear` (and the fused calls), which dispatch on the
    GGML type id; dequantizing goes through gguf-py for all of them."""

    qtype: T
    block: int  # weights per block
    type_size: int  # bytes per block
    packed: bool  # the kernels keep its quants in their own order (`pack_rows`)
    quantize: Callable[[np.ndarray], np.ndarray] | None  # fp32 [N, K] -> uint8 blocks in ggml's order; None: read only


def _gguf_quantizer(qtype: T) -> Callable[[np.ndarray], np.ndarray]:
    def quantize(arr: np.ndarray) -> np.ndarray:
        from gguf.quants import quantize as gguf_quantize

        return gguf_quantize(arr, qtype)
    return quantize


FORMATS: dict[T, BlockFormat] = {f.qtype: f for f in (
    BlockFormat(T.Q4_0, *GGML_QUANT_SIZES[T.Q4_0], True, _gguf_quantizer(T.Q4_0)),
    BlockFormat(T.Q4_1, *GGML_QUANT_SIZES[T.Q4_1], False, _gguf_quantizer(T.Q4_1)),
    BlockFormat(T.Q5_0, *GGML_QUANT_SIZES[T.Q5_0], True, _gguf_quantizer(T.Q5_0)),
    BlockFormat(T.Q8_0, *GGML_QUANT_SIZES[T.Q8_0], True, _gguf_quantizer(T.Q8_0)),
    BlockFormat(T.Q4_K, *GGML_QUANT_SIZES[T.Q4_K], True, lambda arr: _quantize_q4_k(arr)),  # gguf-py has none
    BlockFormat(T.Q6_K, *GGML_QUANT_SIZES[T.Q6_K], True, None),
)}
SUPPORTED_TYPES = frozenset(FORMATS)
K_TYPES = frozenset({T.Q4_K, T.Q6_K})  # 256-weight super-blocks (activations in 256-value blocks)
G32_TYPES = group32_order.TYPES  # 32-weight blocks in groups of eight
PACKED_TYPES = frozenset(t for t, f in FORMATS.items() if f.packed)  # quants in the kernels' order
FALLBACK_ROWS = 4096  # weight rows the fallback dequantizes at a time


def _as_type(qtype) -> T:
    try:
        return T(int(qtype))
    except ValueError as e:
        raise ValueError(f"{qtype!r} is not a GGML quantization type") from e


class QTensor:
    """A [N, K] weight in one GGUF block format: `data` uint8 [N, row_bytes], `qtype`, `shape`."""

    __slots__ = ("data", "qtype", "shape")

    def __init__(self, data, qtype, shape: tuple[int, int], packed: bool = False):
        """`data`: the rows in the file's (ggml's) order; a matrix of a PACKED_TYPES format is copied into
        the kernels' order (`pack_rows`), Q4_1 is wrapped without a copy where it is contiguous.
        `packed=True` says `data` is in the kernels' order already."""
        qtype = _as_type(qtype)
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(f"{qtype.name} is not a supported block format; supported: "
                             f"{sorted(t.name for t in SUPPORTED_TYPES)}")
        n, k = (int(v) for v in shape)
        block, size = FORMATS[qtype].block, FORMATS[qtype].type_size
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
        if qtype in PACKED_TYPES and not packed:
            data = torch.from_numpy(pack_rows(data.numpy(), qtype, k))
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
        return unpack_rows(self.data.numpy(), self.qtype, self.shape[1])

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

    arr = dequantize(unpack_rows(data.contiguous().numpy(), qtype, k), qtype)
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
    lib = library()
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
    contiguous with PRE_RMSNORM. Per row the same computation whatever M is (csrc/fused_linear.c)."""
    m = x.shape[0]
    rc = lib.specfleet_q_linear_fused(parts, nparts, k, x.data_ptr(), x.stride(0), m, pre,
                                      None if pre_weight is None else pre_weight.data_ptr(), eps, y.data_ptr(),
                                      y.stride(0), int(accumulate), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the native fused kernel refused its arguments (code {rc})")
    return y


def quantize(weight: torch.Tensor, qtype) -> QTensor:
    """A dense [N, K] weight in block format `qtype` (one of FORMATS with a quantizer)."""
    qtype = _as_type(qtype)
    fmt = FORMATS.get(qtype)
    if fmt is None or fmt.quantize is None:
        raise ValueError(f"cannot quantize to {qtype.name}; choose one of "
                         f"{[t.name for t, f in FORMATS.items() if f.quantize is not None]}")
    if weight.dim() != 2:
        raise ValueError(f"quantize needs a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k % fmt.block:
        raise ValueError(f"{qtype.name} needs K to be a multiple of {fmt.block}, got shape {(n, k)}")
    data = fmt.quantize(weight.detach().float().cpu().numpy())
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


def pack_rows(data: np.ndarray, qtype, k: int, native: bool = True) -> np.ndarray:
    """Rows of `k` weights from ggml's order into the kernels' (a copy; Q4_1 as it is): `pack_k` for Q4_K /
    Q6_K, groups of eight blocks for Q4_0, Q5_0 and Q8_0 (the C library where it is built, else numpy)."""
    qtype = _as_type(qtype)
    if qtype in K_TYPES:
        return pack_k(data, qtype, native)
    if qtype not in G32_TYPES:
        return data
    lib = library() if native else None
    if lib is None:
        return group32_order.pack(data, qtype, k)
    block, size = FORMATS[qtype].block, FORMATS[qtype].type_size
    src = np.ascontiguousarray(data, dtype=np.uint8)
    out = np.empty_like(src)
    nb = k // block
    if lib.specfleet_g32_pack(int(qtype), src.ctypes.data, out.ctypes.data, src.size // (nb * size) if nb else 0, nb,
                              torch.get_num_threads()) != 0:
        raise ValueError(f"the native kernel cannot pack {qtype.name}")
    return out


def unpack_rows(data: np.ndarray, qtype, k: int) -> np.ndarray:
    """The inverse of `pack_rows`: ggml's order, as gguf-py reads and writes it (Q4_1: `data` itself)."""
    qtype = _as_type(qtype)
    if qtype in K_TYPES:
        return unpack_k(data, qtype)
    return group32_order.unpack(data, qtype, k) if qtype in G32_TYPES else data


def pack_k(data: np.ndarray, qtype, native: bool = True) -> np.ndarray:
    """Q4_K / Q6_K bytes (any shape, whole blocks) from ggml's order into the kernels' order; a copy.
    The C library does it where it is built (numpy's version, `native=False`, moves ~70 MB/s: a
    quarter of a minute for the 1.5B)."""
    qtype = _as_type(qtype)
    lib = library() if native else None
    if lib is None:
        return kquant_order.pack(data, qtype)
    src = np.ascontiguousarray(data, dtype=np.uint8)
    out = np.empty_like(src)
    nblocks = src.size // FORMATS[qtype].type_size
    if lib.specfleet_k_pack(int(qtype), src.ctypes.data, out.ctypes.data, nblocks, torch.get_num_threads()) != 0:
        raise ValueError(f"the native kernel cannot pack {qtype.name}")
    return out
