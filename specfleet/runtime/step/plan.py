"""A step's key plan: which cached keys each query row attends to, built once per step for the native
attention (csrc/q_fused.c, `sf_key_plan`).

Losslessness needs one rule for every row, whatever the step: a row attends, unmasked, to exactly the keys
its own one-token decode step would see, in the same order (its request's context, then the new tokens
its mask lets it see, itself last). Decode rows, prompt chunks, chain and tree verification rows and a
draft's level-drafted rows (part of the context hidden) are all that rule with different key lists, so
the C attention reads one plan and never branches on the kind of step; a verification row and the decode
step of the same token run the same instructions over the same numbers.

A row's keys are its layout indices (its request's token order: context, then new tokens): the first
`plen` of them are 0..plen-1 (a prefix: every decode, prompt and chain row, and a tree row up to its
first hidden sibling) and the rest are listed in `extras`; the layout index x is the cache row
`slots[base + x]` (the request's block table unrolled; a view of the cache is a range).

Worked example: a request with 3 cached tokens verifies [root, a, b] where a and b are siblings (both
children of the root). Row b sees layout 0, 1, 2 (context), 3 (root) and 5 (itself), not 4 (a):
plen = 4 and extras = [5]; nkeys = 5.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from specfleet.runtime.model.attention import AttentionBatch, SeqAttention


def _c(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


@dataclass
class KeyPlan:
    slots: np.ndarray  # int64 [sum of requests' context + new]: cache row of each layout index, per request
    base: np.ndarray  # int64 [rows]: where the row's request starts in `slots`
    plen: np.ndarray  # int64 [rows]: keys 0..plen-1 are the layout prefix
    xoff: np.ndarray  # int64 [rows]: the row's other keys in `extras`
    nkeys: np.ndarray  # int64 [rows]: how many keys the row sees
    extras: np.ndarray  # int64: layout indices of keys past the prefix, row after row

    def c_args(self) -> tuple:
        """The six pointers `specfleet_attend` / `specfleet_decode_layers` take, in order."""
        return tuple(_c(a) for a in (self.slots, self.base, self.plen, self.xoff, self.nkeys, self.extras))

    @classmethod
    def build(cls, batch: AttentionBatch) -> "KeyPlan":
        slots, base, plen, xoff, nkeys, extras = [], [], [], [], [], []
        offset = num_extras = 0
        for seq in batch.seqs:
            n, c = seq.query_len, seq.context_len
            slots.append(_slot_rows(seq))
            base.append(np.full(n, offset, dtype=np.int64))
            offset += c + n
            if seq.new_mask is None and seq.context_mask is None:  # causal: every row a prefix
                p = np.arange(c + 1, c + n + 1, dtype=np.int64)
                plen.append(p)
                nkeys.append(p)
                xoff.append(np.full(n, num_extras, dtype=np.int64))
                continue
            for i in range(n):
                keys = _visible_keys(seq, i)
                prefix = _prefix_len(keys)
                plen.append(np.array([prefix], dtype=np.int64))
                nkeys.append(np.array([len(keys)], dtype=np.int64))
                xoff.append(np.array([num_extras], dtype=np.int64))
                rest = keys[prefix:]
                extras.append(rest)
                num_extras += len(rest)
        cat = lambda parts: np.ascontiguousarray(np.concatenate(parts) if parts else np.zeros(0, np.int64), np.int64)
        extras.append(np.zeros(1, dtype=np.int64))  # never empty, so its pointer is valid
        return cls(cat(slots), cat(base), cat(plen), cat(xoff), cat(nkeys), cat(extras))

    def arrays(self) -> list[np.ndarray]:
        return [self.slots, self.base, self.plen, self.xoff, self.nkeys, self.extras]


def _slot_rows(seq: SeqAttention) -> np.ndarray:
    kv, total = seq.kv, seq.context_len + seq.query_len
    if isinstance(kv, slice):
        start = kv.start or 0
        return np.arange(start, start + total, dtype=np.int64)
    if seq.host_rows is not None:
        return seq.host_rows[:total]
    return kv[:total].to(device="cpu", dtype=torch.int64).numpy()


def _visible_keys(seq: SeqAttention, i: int) -> np.ndarray:
    """Layout indices row i sees, in order: visible context rows, then visible new tokens up to itself."""
    c = seq.context_len
    if seq.context_mask is None:
        ctx = np.arange(c, dtype=np.int64)
    else:
        cm = seq.host_context_mask if seq.host_context_mask is not None else seq.context_mask.cpu().numpy()
        ctx = cm[i].nonzero()[0].astype(np.int64)
    mask = seq.host_mask if seq.host_mask is not None else seq.new_mask
    if mask is None:
        new = np.arange(i + 1, dtype=np.int64)
    else:
        row = mask[i, :i + 1]
        if isinstance(row, torch.Tensor):
            row = row.cpu().numpy()  # host_mask is on the host already: no copy, no device wait
        new = row.nonzero()[0].astype(np.int64)
    return np.concatenate([ctx, new + c])


def _prefix_len(keys: np.ndarray) -> int:
    """How many leading keys are 0, 1, 2, ... (the layout prefix)."""
    off = np.nonzero(keys != np.arange(len(keys)))[0]
    return int(off[0]) if len(off) else len(keys)


def native_attend(lib, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                  scale: float) -> torch.Tensor:
    """`specfleet_attend` (csrc/q_fused.c): rows of q [T, H, D] (fp32, the batch's new tokens in order), each
    over the keys of the batch's key plan in k_cache / v_cache [slots, KVH, D] (fp32, contiguous) ->
    [T, H, D]. The attention the native decoder layers run, callable alone (tests, benchmarks)."""
    t, h, d = q.shape
    if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and q.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("native_attend takes contiguous fp32 tensors")
    plan = KeyPlan.build(batch)
    if len(plan.nkeys) != t:
        raise ValueError(f"the batch has {len(plan.nkeys)} rows, q has {t}")
    if len(plan.slots) and not 0 <= int(plan.slots.min()) <= int(plan.slots.max()) < k_cache.shape[0]:
        raise IndexError(f"the key plan's cache rows must lie in [0, {k_cache.shape[0]})")
    kvh = k_cache.shape[1]
    out = torch.empty_like(q)
    rc = lib.specfleet_attend(q.data_ptr(), t, h, kvh, d, k_cache.data_ptr(), v_cache.data_ptr(), kvh * d,
                              *plan.c_args(), scale, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the native attention refused its arguments (code {rc})")
    return out
