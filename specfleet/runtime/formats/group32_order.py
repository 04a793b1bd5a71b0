"""The kernels' byte order of the grouped 32-weight formats Q4_0, Q5_0 and Q8_0 (csrc/q_common.h, csrc/k_pack.c
`specfleet_g32_pack`), in numpy: the reference of the C re-ordering and the way back to ggml's order that gguf-py
dequantizes.

A row's blocks go in groups of eight (the last group holds the nb % 8 left, nt of them). Within a group of nt
blocks, quant byte c = 4 * (nt * k + j) + t is weight 4k + t of block j, so every 32-bit lane of a register
holds one block's quants. A group is its nt fp16 scales, then (Q5_0) the fifth bits, bit c of
qh[4 * nt] for byte c, then the quants: Q4_0 / Q5_0 nibbles qs[16 * nt] (qs[n]: byte n low, byte n + 16 nt
high), Q8_0 int8 qs[32 * nt]. A group keeps its size, so rows keep theirs.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

TYPES = frozenset({T.Q4_0, T.Q5_0, T.Q8_0})


def _natural(blocks: np.ndarray, qtype: T) -> np.ndarray:
    """[..., block bytes] ggml blocks -> [..., 32] quants in weight order (Q4_0 / Q5_0 unsigned, fifth bit in)."""
    if qtype == T.Q8_0:
        return blocks[..., 2:34].copy()
    qs = blocks[..., 6:22] if qtype == T.Q5_0 else blocks[..., 2:18]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if qtype == T.Q5_0:
        q |= np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little") << 4
    return q


def _ggml(d: np.ndarray, q: np.ndarray, qtype: T) -> np.ndarray:
    """The inverse of `_natural`: [..., 2] scale bytes and [..., 32] quants -> [..., block bytes]."""
    if qtype == T.Q8_0:
        return np.concatenate([d, q], axis=-1)
    qs = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)
    if qtype == T.Q4_0:
        return np.concatenate([d, qs], axis=-1)
    qh = np.packbits((q >> 4) & 1, axis=-1, bitorder="little")
    return np.concatenate([d, qh, qs], axis=-1)


def _pack_groups(g: np.ndarray, qtype: T) -> np.ndarray:
    """[R, G, nt, block bytes] ggml blocks -> [R, G, nt * block bytes] groups in the kernels' order."""
    r, ng, nt, _ = g.shape
    d = g[..., :2].reshape(r, ng, 2 * nt)
    q = _natural(g, qtype).reshape(r, ng, nt, 8, 4).transpose(0, 1, 3, 2, 4).reshape(r, ng, 32 * nt)
    if qtype == T.Q8_0:
        return np.concatenate([d, q], axis=-1)
    half = 16 * nt
    qs = (q[..., :half] & 15) | ((q[..., half:] & 15) << 4)
    if qtype == T.Q4_0:
        return np.concatenate([d, qs], axis=-1)
    qh = np.packbits((q >> 4) & 1, axis=-1, bitorder="little")
    return np.concatenate([d, qh, qs], axis=-1)


def _unpack_groups(p: np.ndarray, qtype: T, nt: int) -> np.ndarray:
    """The inverse of `_pack_groups`: [R, G, nt * block bytes] -> [R, G, nt, block bytes]."""
    r, ng, _ = p.shape
    d = p[..., :2 * nt].reshape(r, ng, nt, 2)
    rest = p[..., 2 * nt:]
    if qtype == T.Q8_0:
        q = rest
    else:
        qs = rest[..., 4 * nt:] if qtype == T.Q5_0 else rest
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)
        if qtype == T.Q5_0:
            q = q | (np.unpackbits(rest[..., :4 * nt], axis=-1, bitorder="little") << 4)
    q = q.reshape(r, ng, 8, nt, 4).transpose(0, 1, 3, 2, 4).reshape(r, ng, nt, 32)
    return _ggml(d, q, qtype)


def _reorder(data: np.ndarray, qtype: T, k: int, groups_fn) -> np.ndarray:
    """Each row's full groups, then its last group of nb % 8 blocks, through groups_fn(groups, nt)."""
    block, size = GGML_QUANT_SIZES[qtype]
    nb = k // block
    rows = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, nb * size)
    full, tail = nb // 8, nb % 8
    out = np.empty_like(rows)
    if full:
        out[:, :8 * full * size] = groups_fn(rows[:, :8 * full * size].reshape(len(rows), full, 8, size), 8).reshape(len(rows), -1)
    if tail:
        out[:, 8 * full * size:] = groups_fn(rows[:, 8 * full * size:].reshape(len(rows), 1, tail, size), tail).reshape(len(rows), -1)
    return out.reshape(data.shape)


def pack(data: np.ndarray, qtype, k: int) -> np.ndarray:
    """Rows of `k` weights (any leading shape, whole rows) from ggml's order into the kernels'; a copy."""
    qtype = T(int(qtype))
    return _reorder(data, qtype, k, lambda g, nt: _pack_groups(g, qtype))


def unpack(data: np.ndarray, qtype, k: int) -> np.ndarray:
    """The inverse of `pack` (and of `qtensor.pack_rows`): back to ggml's order; a copy."""
    qtype = T(int(qtype))
    size = GGML_QUANT_SIZES[qtype][1]
    return _reorder(data, qtype, k, lambda g, nt: _unpack_groups(g.reshape(g.shape[0], g.shape[1], nt * size), qtype, nt))
