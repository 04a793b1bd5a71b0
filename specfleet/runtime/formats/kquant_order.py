"""The kernels' byte order of the K formats (csrc/q_common.h, csrc/k_pack.c), in numpy: the reference of the C
re-ordering `specfleet_k_pack` and the way back to ggml's order that gguf-py dequantizes.

Weight e = 32u + 4t + b of a Q4_K / Q6_K block (u, t in 0..7, b in 0..3) sits at byte 4u + b of 32-byte
register t, so each dword of a register holds one 32-wide sub-block in every register. Scales, mins and
d stay where ggml has them, so a block keeps its size.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

PACK_CHUNK = 1 << 16  # blocks re-ordered at a time (bounds the temporaries to a few MB)


def _interleave(q: np.ndarray) -> np.ndarray:
    """[B, 256] quants in element order -> [B, 8, 32] registers (register t, byte 4u + b)."""
    return q.reshape(-1, 8, 8, 4).transpose(0, 2, 1, 3).reshape(-1, 8, 32)


def _deinterleave(v: np.ndarray) -> np.ndarray:
    """[B, 8, 32] registers -> [B, 256] quants in element order (the inverse of `_interleave`)."""
    return v.reshape(-1, 8, 8, 4).transpose(0, 2, 1, 3).reshape(-1, 256)


def _q4k_pack(blk: np.ndarray) -> np.ndarray:
    qs = blk[:, 16:]
    q = np.stack([qs.reshape(-1, 4, 32) & 15, qs.reshape(-1, 4, 32) >> 4], axis=2).reshape(-1, 256)
    v = _interleave(q)
    out = blk.copy()
    out[:, 16:] = (v[:, :4] | (v[:, 4:] << 4)).reshape(-1, 128)
    return out


def _q4k_unpack(blk: np.ndarray) -> np.ndarray:
    qs = blk[:, 16:].reshape(-1, 4, 32)
    q = _deinterleave(np.concatenate([qs & 15, qs >> 4], axis=1)).reshape(-1, 4, 2, 32)
    out = blk.copy()
    out[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return out


def _q6k_pack(blk: np.ndarray) -> np.ndarray:
    ql = blk[:, :128].reshape(-1, 2, 2, 32)  # [half, l or 32 + l, l]
    qh = blk[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.stack([ql & 15, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # quarters 0..3 of a half
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    v = _interleave((low | (high << 4)).reshape(-1, 256))
    out = blk.copy()
    out[:, :128] = ((v[:, :4] & 15) | ((v[:, 4:] & 15) << 4)).reshape(-1, 128)
    top = (v >> 4).reshape(-1, 2, 4, 32) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    out[:, 128:192] = np.bitwise_or.reduce(top, axis=2).reshape(-1, 64)
    return out


def _q6k_unpack(blk: np.ndarray) -> np.ndarray:
    ql = blk[:, :128].reshape(-1, 4, 32)
    qh = blk[:, 128:192].reshape(-1, 2, 1, 32)
    top = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(-1, 8, 32)
    q = _deinterleave(np.concatenate([ql & 15, ql >> 4], axis=1) | (top << 4)).reshape(-1, 2, 4, 32)
    out = blk.copy()
    out[:, :128] = ((q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)).reshape(-1, 128)
    high = (q >> 4) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    out[:, 128:192] = np.bitwise_or.reduce(high, axis=2).reshape(-1, 64)
    return out


def _reorder(data: np.ndarray, qtype: T, fn) -> np.ndarray:
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, size)
    out = np.empty_like(blocks)
    for i in range(0, len(blocks), PACK_CHUNK):
        out[i:i + PACK_CHUNK] = fn(blocks[i:i + PACK_CHUNK])
    return out.reshape(data.shape)



def pack(data: np.ndarray, qtype) -> np.ndarray:
    """Q4_K / Q6_K bytes (any shape, whole blocks) from ggml's order into the kernels' order; a copy
    (~70 MB/s: `qtensor.pack_k` uses the C version where it is built)."""
    qtype = T(int(qtype))
    return _reorder(data, qtype, {T.Q4_K: _q4k_pack, T.Q6_K: _q6k_pack}[qtype])


def unpack(data: np.ndarray, qtype) -> np.ndarray:
    """The inverse of `pack` (and of `qtensor.pack_k`): back to ggml's order (what gguf-py dequantizes); a copy."""
    qtype = T(int(qtype))
    return _reorder(data, qtype, {T.Q4_K: _q4k_unpack, T.Q6_K: _q6k_unpack}[qtype])
