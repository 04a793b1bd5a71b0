"""Attention over a ragged batch whose keys and values live in a paged KV cache.

A ragged batch packs the new tokens of many requests into one [num_tokens, ...] tensor with no
padding. Request i contributes `query_len` new tokens placed after `context_len` tokens already
cached. Its queries attend to its own cached tokens and, among its new tokens, to those allowed by
its mask: causal by default, or any [new, new] boolean mask (a draft tree's ancestor mask). A draft
model drafting a tree level by level may also hide part of the context ([new, context + new] mask).
Nothing ever attends across requests.

Reading the cache: when a request's blocks are consecutive (the block manager allocates them so
whenever it can) its keys and values are a view of the cache and nothing is copied; otherwise its
rows are gathered, once per layer. Grouped-query attention is computed without repeating K/V over
the context: the G = num_heads / num_kv_heads query heads that share one KV head are folded into
the query-row dimension, row order (token, group), so each KV head does one [n*G, L] attention.

Cost that grows as it should (CPU): a prompt chunk or a verify tree with cached context is split in
two attentions merged by their log-sum-exps: the queries against the context, with no mask at all,
and the queries against the new tokens, causal (which the flash kernel computes on the lower
triangle only) or with the tree mask. A mask over the whole [n*G, context + n] rectangle is never
built, and no score matrix of that size is materialized. Worked example of the merge: if a query's
scores over the context have log-sum-exp a and output o_a, and over the new tokens b and o_b, then
attention over both is (e^a o_a + e^b o_b) / (e^a + e^b) = w o_a + (1 - w) o_b with
w = sigmoid(a - b). On CUDA one batch-invariant kernel call per layer attends every row of the step over the
keys of its key plan (runtime/backends/cuda/kernels.py), as the C attention does on the CPU for native models; with
the CUDA kernels off, one masked SDPA call per request does the whole attention.

Sliding-window layers (Gemma-3): a query sees only the last `window` of the keys it would otherwise
see, itself included. A query's visible keys, in cache order, are one token per position 0..p (its
request's committed tokens, then its ancestors in a draft tree), so this is the keys at positions
> p - window, as transformers and llama.cpp mask them. Keys older than every query's window are cut
before anything is read (`SeqAttention.windowed`); decode and verification rows then attend, each
alone, to exactly their window (a slice of the cache, so verification stays bit for bit the decode
step); a prompt chunk goes in blocks of queries, each over the band of keys its rows can see, so the
cost grows with chunk x window, not chunk x context; masked rows (trees, hidden context) mask it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

# the CPU flash kernel also returns the log-sum-exp of each query row, which the split needs
_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# a step's rows for one request up to which each row attends on its own, as its decode step would
# (verification sizes); longer runs (prompt chunks) take the split flash path below
ROWWISE_ROWS = 16
# query rows per block of a sliding-window prompt chunk (each block reads its band of keys)
WINDOW_BLOCK = 128


@dataclass
class SeqAttention:
    """One request's attention layout for one step, built by the model runner and read by every layer."""

    query_len: int
    context_len: int
    kv: slice | torch.Tensor  # cache rows of its context_len + query_len tokens: a slice, or gathered indices
    new_mask: torch.Tensor | None = None  # [query, query] bool among the new tokens; None = causal
    context_mask: torch.Tensor | None = None  # [query, context] bool; None = the whole context is visible
    host_mask: np.ndarray | None = None  # new_mask as the runner built it on the host (read without a device sync)
    host_context_mask: np.ndarray | None = None  # context_mask's host copy
    host_rows: np.ndarray | None = None  # when `kv` is gathered indices: their host copy (int64)
    _bias: dict = field(default_factory=dict, repr=False)  # additive masks folded per group, made once per step
    _row_keys: dict = field(default_factory=dict, repr=False)  # device -> each row's gathered key indices
    _windowed: dict = field(default_factory=dict, repr=False)  # window -> this layout cut to it, made once per step

    def bias(self, group: int, with_context: bool, device: torch.device, dtype: torch.dtype,
             window: int | None = None) -> torch.Tensor:
        """Additive mask [query*G, (context +) query] over folded query rows (0 visible, -inf hidden);
        with `window` each row keeps only its last `window` visible keys (needs with_context)."""
        key = (group, with_context, dtype, window)
        if key not in self._bias:
            n = self.query_len
            new = self.new_mask if self.new_mask is not None else causal_mask(n, device)
            visible = new.to(device)
            if with_context:
                ctx = (self.context_mask.to(device) if self.context_mask is not None
                       else torch.ones(n, self.context_len, dtype=torch.bool, device=device))
                visible = torch.cat([ctx, visible], dim=1)
            if window is not None:  # rank of each visible key counted from the row's last one (itself)
                visible &= visible.flip(-1).cumsum(-1).flip(-1) <= window
            bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            self._bias[key] = bias.repeat_interleave(group, dim=0)
        return self._bias[key]

    def row_keys(self, device: torch.device) -> list[torch.Tensor | None]:
        """For each new token, the layout indices of the keys its decode step sees when they are not a
        prefix (the context, then its visible new tokens), or None when they are: made once per step
        from the host copy of the mask, so no layer waits on the device for it."""
        if device not in self._row_keys:
            mask = self.host_mask if self.host_mask is not None else self.new_mask.cpu().numpy()
            c, rows = self.context_len, []
            for i in range(self.query_len):  # host arithmetic in numpy: no tensor op, no device wait
                seen = mask[i, :i + 1].nonzero()[0]
                rows.append(None if len(seen) == i + 1 else np.concatenate([np.arange(c), seen + c]))
            flat = [r for r in rows if r is not None]
            if flat:  # one host-to-device copy for all of them
                moved = torch.from_numpy(np.concatenate(flat)).to(device, non_blocking=True)
                it = iter(moved.split([len(r) for r in flat]))
                rows = [None if r is None else next(it) for r in rows]
            self._row_keys[device] = rows
        return self._row_keys[device]

    def windowed(self, window: int) -> "SeqAttention":
        """This layout without the context rows that no query's window reaches: with the whole context
        visible, the first new token (the oldest query) sees rows > context_len - window, and every later
        query fewer. A hidden context (a tree drafted level by level) is kept whole."""
        cut = self.context_len - window + 1
        if cut <= 0 or self.context_mask is not None:
            return self
        if window not in self._windowed:
            kv = self.kv
            kv = slice((kv.start or 0) + cut, kv.stop, kv.step) if isinstance(kv, slice) else kv[cut:]
            self._windowed[window] = SeqAttention(self.query_len, self.context_len - cut, kv, self.new_mask,
                                                  host_mask=self.host_mask)
        return self._windowed[window]


@dataclass
class AttentionBatch:
    """Per-step attention layout, built once per step by the model runner and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    seqs: list[SeqAttention]
    # the step's key plan on the device (runtime/backends/cuda/kernels.DevicePlan, which attends over it),
    # set by the runner when the CUDA kernels attend
    plan: object | None = None
    # the step's key plan on the host (runtime/step/plan.KeyPlan), built once per step by the runner when the
    # bound backend reads one (the native layers, the CUDA kernels)
    key_plan: object | None = None

    @property
    def query_lens(self) -> list[int]:
        return [s.query_len for s in self.seqs]


def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotary already applied
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], new keys already written
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    batch: AttentionBatch,
    scale: float,
    out: torch.Tensor | None = None,  # where to write the result (a [num_tokens, num_heads, head_dim] tensor)
    window: int | None = None,  # a sliding-window layer: each query sees its last `window` keys only
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_kv_heads = k_cache.shape[1]
    if batch.plan is not None and window is None:  # CUDA: one batch-invariant call for every row of the step
        o = batch.plan.attend(q, k_cache, v_cache, scale)
        return o if out is None else out.copy_(o)
    out = torch.empty_like(q) if out is None else out
    start = 0
    for seq in batch.seqs:
        n = seq.query_len
        if window is not None:
            seq = seq.windowed(window)
        ki, vi = k_cache[seq.kv], v_cache[seq.kv]  # [L, KVH, D]: a view, or a gather when fragmented
        out[start:start + n] = _attend(q[start:start + n], ki, vi, seq, num_kv_heads, scale, window)
        start += n
    return out


def _fold(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, H, D] -> [1, KVH, n*G, D], rows in (token, group) order."""
    n, h, d = x.shape
    return x.view(n, num_kv_heads, h // num_kv_heads, d).transpose(0, 1).reshape(1, num_kv_heads, -1, d)


def _unfold(x: torch.Tensor, n: int) -> torch.Tensor:
    """[1, KVH, n*G, D] -> [n, H, D] (the inverse of _fold)."""
    kvh, d = x.shape[1], x.shape[3]
    return x[0].view(kvh, n, -1, d).transpose(0, 1).reshape(n, -1, d)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, KVH, D] cache rows -> [1, KVH, L, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _attend(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor, seq: SeqAttention, num_kv_heads: int,
            scale: float, window: int | None = None) -> torch.Tensor:
    """One request: qi [n, H, D], ki/vi [context + n, KVH, D] -> [n, H, D]. With `window` each query sees
    only its last `window` visible keys (`_attend_window`). (Native GGUF models attend in C over a key
    plan instead: runtime/step/plan.py.)"""
    if window is not None:
        return _attend_window(qi, ki, vi, seq, num_kv_heads, scale, window)
    n, c = seq.query_len, seq.context_len
    group = qi.shape[1] // num_kv_heads
    qf = _fold(qi, num_kv_heads)
    k, v = _heads_first(ki), _heads_first(vi)
    if n == 1 and seq.context_mask is None:  # one new token sees the whole sequence: no mask at all
        return _unfold(F.scaled_dot_product_attention(qf, k, v, scale=scale), n)
    if c and n <= ROWWISE_ROWS and seq.context_mask is None:
        return _attend_rowwise(qi, k, v, seq, num_kv_heads, scale)
    can_split = _cpu_flash is not None and qi.device.type == "cpu"
    if not can_split or seq.context_mask is not None:
        bias = seq.bias(group, True, qi.device, qi.dtype)
        return _unfold(F.scaled_dot_product_attention(qf, k, v, attn_mask=bias, scale=scale), n)
    o_new, lse_new = _attend_new(qi, qf, k[:, :, c:], v[:, :, c:], seq, group, scale)
    if c == 0:
        return o_new
    o_ctx, lse_ctx = _cpu_flash(qf, k[:, :, :c], v[:, :, :c], 0.0, False, scale=scale)
    w = torch.sigmoid(_unfold(lse_ctx.unsqueeze(-1), n) - lse_new)  # [n, H, 1]: the context's share
    return torch.lerp(o_new.float(), _unfold(o_ctx, n).float(), w).to(qi.dtype)


def _attend_window(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor, seq: SeqAttention, num_kv_heads: int,
                   scale: float, window: int) -> torch.Tensor:
    """A sliding-window layer's attention for one request (see the module doc). Decode and verification
    rows go row by row over exactly their window (what `_attend_rowwise` does for full layers); a causal
    chunk goes in blocks over bands of keys; other masked rows mask the window off their visible keys."""
    n, c = seq.query_len, seq.context_len
    k, v = _heads_first(ki), _heads_first(vi)
    if seq.context_mask is None and (n == 1 or (c and n <= ROWWISE_ROWS)):
        return _attend_rowwise(qi, k, v, seq, num_kv_heads, scale, window)
    if seq.context_mask is None and seq.new_mask is None:
        return _attend_band(qi, k, v, c, num_kv_heads, scale, window)
    bias = seq.bias(qi.shape[1] // num_kv_heads, True, qi.device, qi.dtype, window)
    return _unfold(F.scaled_dot_product_attention(_fold(qi, num_kv_heads), k, v, attn_mask=bias, scale=scale), n)


def _attend_band(qi: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: int, num_kv_heads: int, scale: float,
                 window: int) -> torch.Tensor:
    """Causal rows with a sliding window: query i (cache row c + i) sees rows (c + i - window, c + i].
    Blocks of WINDOW_BLOCK rows each attend over the band of rows any of them sees, with a band mask."""
    n = qi.shape[0]
    group = qi.shape[1] // num_kv_heads
    out = torch.empty_like(qi)
    for a in range(0, n, WINDOW_BLOCK):
        b = min(n, a + WINDOW_BLOCK)
        lo, hi = max(0, c + a - window + 1), c + b
        rows = torch.arange(c + a, c + b, device=qi.device)[:, None]
        cols = torch.arange(lo, hi, device=qi.device)[None, :]
        visible = (cols <= rows) & (cols > rows - window)
        bias = torch.zeros(visible.shape, dtype=qi.dtype, device=qi.device).masked_fill_(~visible, float("-inf"))
        o = F.scaled_dot_product_attention(_fold(qi[a:b], num_kv_heads), k[:, :, lo:hi], v[:, :, lo:hi],
                                           attn_mask=bias.repeat_interleave(group, dim=0), scale=scale)
        out[a:b] = _unfold(o, b - a)
    return out


def _attend_rowwise(qi: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqAttention, num_kv_heads: int,
                    scale: float, window: int | None = None) -> torch.Tensor:
    """Verification rows (a draft chain or tree after a context), each attended exactly as its own
    one-token decode step would be: the same unmasked call over the same keys in the same order (the
    context, then the row's ancestors and itself). So a verified token gets bit for bit the attention
    output that decoding it alone gives, and with batch-invariant linear layers speculative greedy
    output equals plain greedy output, not only up to rounding. A chain row's keys are a prefix of
    the request's rows (a view); a tree row whose ancestors are not a prefix gathers its keys. With
    `window` a row takes the last `window` of those keys (a decode step of a sliding-window layer runs
    here too, so both see the same keys)."""
    n, c = seq.query_len, seq.context_len
    out = torch.empty_like(qi)
    row_keys = seq.row_keys(k.device) if seq.new_mask is not None else [None] * n
    for i in range(n):
        first = 0 if window is None else max(0, c + i + 1 - window)
        idx = row_keys[i]
        if idx is None:  # the context and every earlier new token: a prefix of the rows
            ki, vi = k[:, :, first:c + i + 1], v[:, :, first:c + i + 1]
        else:
            if window is not None:
                idx = idx[-window:]
            ki, vi = k.index_select(2, idx), v.index_select(2, idx)
        out[i] = _unfold(F.scaled_dot_product_attention(_fold(qi[i:i + 1], num_kv_heads), ki, vi, scale=scale), 1)[0]
    return out


def _attend_new(qi, qf, k, v, seq: SeqAttention, group: int, scale: float):
    """Attention of the new tokens among themselves (CPU flash kernel): output [n, H, D] and log-sum-exp
    [n, H, 1]. Causal runs unfolded with is_causal, which skips the upper triangle; a tree mask runs
    folded with its bias."""
    n = seq.query_len
    if seq.new_mask is None:
        k_rep = k.repeat_interleave(group, dim=1)  # [1, H, n, D]: only the new tokens are repeated
        v_rep = v.repeat_interleave(group, dim=1)
        o, lse = _cpu_flash(qi.transpose(0, 1).unsqueeze(0), k_rep, v_rep, 0.0, True, scale=scale)
        return o[0].transpose(0, 1), lse[0].transpose(0, 1).unsqueeze(-1)
    o, lse = _cpu_flash(qf, k, v, 0.0, False, attn_mask=seq.bias(group, False, qi.device, qi.dtype), scale=scale)
    return _unfold(o, n), _unfold(lse.unsqueeze(-1), n)
