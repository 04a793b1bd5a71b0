"""CUDA graphs of the step shapes that repeat: B requests with the same number n of new tokens each that see
their whole context (plain decoding, n = 1, and a draft model's chain drafting; verification of a k-token
chain, n = k + 1, or of an n-node tree), logits for every new row or for each request's last. On a GPU this runtime is launch-bound (a 1.5B step
took 15-25 ms on an H200 whose memory reads its weights in 0.7 ms; benchmarks/RESULTS.md), so replaying a
captured step instead of launching each operation from Python is what lets the step approach memory speed.

How. A step of such a shape is padded to the next of `BATCHES` requests: a padding request repeats request
0 (its tokens, positions, cache slots and keys), so it computes what request 0 computes and writes the same
values to the same cache rows; nothing else sees it. Every tensor the forward reads (token ids, positions,
slot mapping, logit rows and the key plan of runtime/step/plan.py) lives in one static device buffer per
shape, filled from the host in one copy; the forward, its batch-invariant kernels (runtime/backends/cuda/kernels.py)
and the head run from the captured graph. Rows are computed by the same kernels in the same order as in
an eager step, so a row's logits are the same bits either way (tests/runtime/backends/cuda/test_on_gpu.py checks it on a GPU; on the
CPU, tests/runtime/backends/cuda/test_route_on_cpu.py runs the same padded path without capture).

Requests with fewer new tokens than the step's most (trees and chains of different sizes in one batch) are
padded to it the same way: a request repeats its own last row (token, position, cache slot and keys), which
computes that row again and writes the same bits to the same cache row; the real rows are gathered back. The
step's n itself is rounded up to one of `NEW_BUCKETS` the same way, so fewer shapes are captured.

A tree is the same shape as a chain of as many nodes: which new tokens a row sees is data of the key plan
(its `plen` prefix and its `extras`, runtime/step/plan.py), positions are data too, and the attention
reads nothing else, so one captured graph serves chains and trees of n nodes alike. (A weightless draft's
tree at batch one was verified eagerly before: on an H200 a SmolLM2-135M tree step cost ~10 graph steps, and
the fleet rightly stopped drafting, at 0.95x plain.)

Capture happens at a shape's first step, on that step's own data: the forward is run twice to warm up
(Triton compiles; the writes are the step's own, repeated), captured, then replayed. That step is slow:
`captures` counts them, and the engine tells the cost models (core/proposer.StepTiming.warmups) so they
leave it untimed. A step whose keys do not fit the shape's buffer, rows that hide part of their context
(a draft model's level-drafted tree), a sliding-window model, or a shape whose capture failed (logged once)
runs eagerly. Measured on an H200 (benchmarks/RESULTS.md): a decode step of the 1.5B's shape in 5.0
ms instead of 16.3, plain decoding 158 tok/s instead of 32 at batch 1, 1,090 instead of 497 at batch 8.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from specfleet.runtime.backends.cuda import kernels as cuda_kernels
from specfleet.runtime.model.attention import AttentionBatch

log = logging.getLogger(__name__)

BATCHES = (1, 2, 4, 8, 16, 24, 32)  # padded request counts
MAX_NEW = 16  # new tokens per request (a verified chain of up to 15 drafted tokens)
# a step's n is padded up to one of these (its requests repeat their last rows), so a batch of ragged trees meets
# 8 shapes rather than 16: each shape's first step captures its graph (three forwards and the capture, ~90 ms for
# SmolLM2-135M on an H200), and one 8-prompt wave of the default fleet at batch 8 captured 14 shapes in the run
NEW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
MAX_LOGITS_BYTES = 256 << 20  # a shape's captured logits stay allocated: larger ones run eagerly


class StepGraphs:
    """The captured steps of one model runner, by (padded requests, new tokens each, logit rows each)."""

    def __init__(self, runner, budget_bytes: int | None = None):
        self.runner = runner
        self.capacity = runner.kv.k[0].shape[0]  # key slots a step's plan may list (the cache's rows)
        self._shapes: dict[tuple[int, int, int], _Shape] = {}
        # the memory plan of the captured shapes: each keeps its logits and hidden states allocated, and
        # together they stay within `budget_bytes` (RuntimeConfig.cuda_graph_bytes); a new shape that does
        # not fit runs eagerly. `planned_bytes` is what the shapes admitted so far keep.
        self.budget_bytes = runner.model.runtime.cuda_graph_bytes if budget_bytes is None else budget_bytes
        self.planned_bytes = 0
        self.over_budget = 0  # steps that ran eagerly because their shape did not fit the plan
        self._pool = None
        self.replays = 0  # steps served by a graph (or by the padded path on the CPU)
        self.eager = 0  # steps of a graph shape that ran eagerly (too many keys)
        self.captures = 0  # shapes captured (each at a step that ran its forward three times)
        self.tree_replays = 0  # replays of steps with a tree (a row that does not see every earlier new token)
        self.ragged_replays = 0  # replays of steps whose requests had fewer new tokens than the shape's n
        model = runner.model
        self._windowed = any(getattr(layer.self_attn, "window", None) for layer in model.layers)

    def shape_of(self, items) -> tuple[int, int, int] | None:
        """(padded requests, n, logit rows each) when every item is at most n new tokens that see their whole
        context (a chain, a tree), n the most of any, with logits for all its rows or its last one (the same
        for every item that has more than one row); else None."""
        if self._windowed or not items or len(items) > BATCHES[-1]:
            return None
        n = max(len(it.token_ids) for it in items)
        if not 1 <= n <= MAX_NEW:
            return None
        n = next(x for x in NEW_BUCKETS if x >= n)
        every = None
        for it in items:
            m = len(it.token_ids)
            if not m or not _sees_context(it):
                return None
            if m == 1:  # its one row is both its last and all of them
                if list(it.logit_indices) != [0]:
                    return None
                continue
            kind = True if list(it.logit_indices) == list(range(m)) else \
                False if list(it.logit_indices) == [m - 1] else None
            if kind is None or (every is not None and kind != every):
                return None
            every = kind
        nlog = n if every or (every is None and n == 1) else 1
        padded = next(b for b in BATCHES if b >= len(items))
        key = (padded, n, nlog)
        if key in self._shapes:
            return key
        need = self.shape_bytes(key)
        if padded * nlog * self._vocab() * 4 > MAX_LOGITS_BYTES:
            return None
        if self.planned_bytes + need > self.budget_bytes:
            self.over_budget += 1  # eager: its outputs would not fit the plan (a step of it is as exact either way)
            return None
        return key

    @staticmethod
    def ahead(max_batch: int, max_new: int) -> list[tuple[int, int]]:
        """The (requests, new tokens each) of the steps that make, before any request, the shapes of plain
        decoding and of verification that steps of up to `max_batch` requests and `max_new` new tokens each meet
        (padded batches of BATCHES, n of NEW_BUCKETS; engine/engine.py Engine.capture_graphs runs them on scratch
        requests): a request's first steps then replay graphs instead of capturing them (one 8-prompt wave of
        the default fleet at batch 8 on an H200 captured 14 shapes while it ran, at 603 tok/s against plain's
        1,396). Narrow shapes come first (decode at every batch size, then ever wider verification), so a plan
        too small for all of them (RuntimeConfig.cuda_graph_bytes; shape_of leaves the rest to run eagerly, as
        they would) keeps the shapes most steps meet."""
        top = next(x for x in NEW_BUCKETS if x >= min(max(max_new, 1), MAX_NEW))  # the size max_new rounds up to
        return [(b, n) for n in NEW_BUCKETS if n <= top for b in BATCHES if b <= max(max_batch, 1)]

    def _vocab(self) -> int:
        return self.runner.vocab_limit or self.runner.model.config.vocab_size

    def shape_bytes(self, key: tuple[int, int, int]) -> int:
        """Bytes a captured shape keeps allocated: its fp32 logits and its hidden states (model dtype)."""
        padded, n, nlog = key
        cfg = self.runner.model.config
        embed = getattr(self.runner.model, "embed_tokens", None)
        itemsize = embed.weight.element_size() if embed is not None else 4
        return padded * nlog * self._vocab() * 4 + padded * n * cfg.hidden_size * itemsize

    def run(self, key: tuple[int, int, int], real: int, arrays: list[np.ndarray], plan: list[np.ndarray],
            batch: AttentionBatch, lens: list[int]) -> torch.Tensor | None:
        """The logits of a step of shape `key` with `real` requests of `lens` new tokens each,
        in the eager step's row order; None when it must run eagerly (its keys overflow the buffer)."""
        b, n, nlog = key
        slots = plan[0]
        if len(slots) > self.capacity:
            self.eager += 1
            return None
        shape = self._shapes.get(key)
        if shape is None:
            need = self.shape_bytes(key)
            if self.planned_bytes + need > self.budget_bytes:  # (shape_of checked it; a caller may not have)
                self.eager += 1
                return None
            shape = self._shapes[key] = _Shape(key, self.capacity, self.runner.device)
            self.planned_bytes += need
        if len(plan[5]) > shape.sizes[8]:  # (_sees_context bounds it; a caller may not have asked)
            self.eager += 1
            return None
        ragged = shape.fill(real, arrays, plan, lens)
        batch.slot_mapping, batch.plan = shape.slot_mapping, shape.plan
        if self.runner.device.type == "cuda" and shape.graph is None and not shape.failed:
            try:
                self._capture(shape, batch)
            except Exception as e:  # noqa: BLE001 -- a shape that cannot be captured runs eagerly, as before
                shape.failed = True
                log.warning("CUDA graph of step shape %s not captured (%s: %s); it runs eagerly", key,
                            type(e).__name__, e)
        if shape.failed:
            self.eager += 1
            return None
        self.tree_replays += shape.tree
        self.ragged_replays += ragged
        if shape.graph is not None:
            shape.graph.replay()
        else:  # the CPU (tests): the same padded forward, run eagerly
            shape.logits, shape.hidden = self._forward(shape, batch)
        self.replays += 1
        if not ragged:
            if self.runner.keep_hidden:
                self.runner.last_hidden = shape.hidden[:real * n].clone()
            return shape.logits[:real * nlog].clone()
        # the real rows of each request (its first lens[r] of n; with last-row logits its last is a copy of its own)
        real_rows = np.concatenate([r * n + np.arange(m, dtype=np.int64) for r, m in enumerate(lens)])
        take = torch.from_numpy(real_rows).to(shape.logits.device, non_blocking=True)
        if self.runner.keep_hidden:
            self.runner.last_hidden = shape.hidden.index_select(0, take)
        return shape.logits[:real * nlog].clone() if nlog == 1 else shape.logits.index_select(0, take)

    def _forward(self, shape: "_Shape", batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.runner.model
        for rotary in (model.rotary, model.rotary_local):  # its cache is keyed by the positions tensor, static here
            if rotary is not None:
                rotary._last = None
        hidden = model(shape.ids, shape.pos, batch, self.runner.kv)
        return model.compute_logits(hidden.index_select(0, shape.rows), self.runner.vocab_limit), hidden

    def _capture(self, shape: "_Shape", batch: AttentionBatch) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on the step's own data: Triton compiles, allocations settle
            for _ in range(2):
                self._forward(shape, batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: drafter threads (engine/pipeline.py) may launch on their own streams meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            shape.logits, shape.hidden = self._forward(shape, batch)
        shape.graph = graph
        self.captures += 1


def _sees_context(it) -> bool:
    """Whether every new row of an item sees its whole context and, among the new tokens, itself and only
    earlier ones (a chain, or a tree in topological order): then its keys past the context prefix are at
    most n(n-1)/2, which the shape's `extras` buffer holds. Rows that hide context keys (a draft model's
    level-drafted rows) can list more and run eagerly."""
    n, c = len(it.token_ids), it.context_len
    mask = it.new_mask
    if mask is None:
        return True
    mask = np.asarray(mask)
    if mask.shape == (n, c + n):
        if not mask[:, :c].all():
            return False
        mask = mask[:, c:]
    return mask.shape == (n, n) and bool(mask.diagonal().all()) and not np.triu(mask, 1).any()


class _Shape:
    """One step shape's static device buffer: ids, positions, slot mapping, logit rows, then the key plan
    (base, plen, xoff, nkeys, extras, slots), all int64, filled from one pinned host buffer in one copy.
    `extras` holds the tree rows' keys past their prefix: at most n(n-1)/2 per request (_sees_context), and
    a padding request reads request 0's (its xoff repeats request 0's)."""

    def __init__(self, key: tuple[int, int, int], capacity: int, device: torch.device):
        b, n, nlog = key
        self.key, t = key, b * n
        self.sizes = [t, t, t, b * nlog, t, t, t, t, b * n * (n - 1) // 2 + 1, capacity]
        self.tree = False  # whether the step last filled in is a tree
        total = sum(self.sizes)
        self.flat = torch.zeros(total, dtype=torch.long, device=device)
        self.host = torch.zeros(total, dtype=torch.long, device="cpu", pin_memory=device.type == "cuda")
        ids, pos, slot_mapping, rows, base, plen, xoff, nkeys, extras, slots = self.flat.split(self.sizes)
        self.ids, self.pos, self.slot_mapping, self.rows = ids, pos, slot_mapping, rows
        self.plan = cuda_kernels.DevicePlan(slots, base, plen, xoff, nkeys, extras)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False  # capture failed: the shape runs eagerly
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self._event = None

    def fill(self, real: int, arrays: list[np.ndarray], plan: list[np.ndarray], lens: list[int]) -> bool:
        """Copy a step of `real` requests with lens[r] new tokens each into the buffer: a request with fewer
        than n repeats its last row up to n (the same token, position, cache slot and keys: it computes
        that row's values again and writes the same bits to the same cache row), and requests real..b-1
        repeat request 0. Returns whether any request was so padded."""
        b, n, nlog = self.key
        ids, pos, slot_mapping, _ = arrays
        slots, base, plen, xoff, nkeys, extras = plan
        self.tree = len(extras) > 1  # (extras ends with one sentinel)
        ragged = any(m != n for m in lens)
        if ragged:
            starts = np.cumsum([0] + lens[:-1])
            idx = np.concatenate([s + np.minimum(np.arange(n), m - 1) for s, m in zip(starts, lens)])
            ids, pos, slot_mapping, base, plen, xoff, nkeys = (a[idx] for a in (ids, pos, slot_mapping, base, plen,
                                                                               xoff, nkeys))
        rep = lambda a: np.concatenate([a, np.tile(a[:n], b - real)]) if b > real else a  # noqa: E731 (request 0 again)
        if nlog == n:
            rows = np.arange(b * n, dtype=np.int64)
        else:
            rows = np.arange(b, dtype=np.int64) * n + (n - 1)
        host = self.host.numpy()
        if self._event is not None and not self._event.query():
            self._event.synchronize()  # the previous step's copy must leave the pinned buffer first
        parts = [rep(ids), rep(pos), rep(slot_mapping), rows, rep(base), rep(plen), rep(xoff), rep(nkeys),
                 extras, slots]
        offset = 0
        for size, part in zip(self.sizes, parts):
            host[offset:offset + len(part)] = part
            offset += size
        used = sum(self.sizes[:-1]) + len(slots)
        self.flat[:used].copy_(self.host[:used], non_blocking=True)
        if self.flat.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        return ragged
