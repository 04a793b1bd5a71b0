"""Runs one model over a ragged batch: builds positions, slot mappings and masks, returns logits.

This is the only layer between bookkeeping and the device. It owns the model and its KV cache
tensors; each item brings its request's block table (from the cache's BlockManager). It also owns
the two things every verifier of a draft tree needs, so the target and a staged draft share them:
the tree's forward item (`tree_item`: positions and mask of a prefix with a tree below its last
token) and `commit_path` (keep an accepted path's KV, drop the rest).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specfleet.runtime.backends.bind import bind
from specfleet.runtime.backends.cuda import kernels as cuda_kernels
from specfleet.runtime.kv.blocks import BlockManager
from specfleet.runtime.model.attention import AttentionBatch, SeqAttention
from specfleet.runtime.kv.cache import KVCache
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.runtime.step.plan import KeyPlan


@dataclass
class ForwardItem:
    """One request's share of a forward pass.

    The new tokens occupy KV layout indices [context_len, context_len + n). Their rotary positions
    default to the same indices; a draft tree passes each node's own (committed tokens + depth - 1) instead,
    because siblings sit side by side in the layout but share a position.
    """

    request_id: str
    token_ids: list[int]
    context_len: int
    logit_indices: list[int]  # which of the new tokens need logits, relative to the first new token
    positions: list[int] | None = None
    # bool visibility of the new tokens: [n, n] over the new tokens (the whole context is visible),
    # or [n, context_len + n] when part of the context must stay hidden (a tree drafted level by level)
    new_mask: np.ndarray | torch.Tensor | None = None  # host data: numpy, or a CPU tensor
    block_ids: list[int] | None = None  # the request's block table; None: looked up in execute's `blocks`


def tree_item(request_id: str, tokens: list[int], context_len: int, tree: DraftTree,
              block_ids: list[int] | None = None) -> ForwardItem:
    """The forward of `tokens` (causal, after `context_len` cached ones) with `tree` hanging below the
    last of them (the tree's root): logits for the root and every node. The layout puts node j at
    context_len + len(tokens) + j; its rotary position is the root's plus its depth."""
    n_prefix = len(tokens)
    logit_rows = list(range(n_prefix - 1, n_prefix + len(tree)))
    if not len(tree):
        return ForwardItem(request_id, tokens, context_len, logit_rows, block_ids=block_ids)
    n = n_prefix + len(tree)
    mask = np.tri(n, dtype=bool)  # the prefix is causal
    mask[n_prefix - 1:, n_prefix - 1:] = tree.verify_mask()  # the tree below its root
    mask[n_prefix:, :n_prefix - 1] = True  # every node sees the whole prefix
    root = context_len + n_prefix - 1
    positions = list(range(context_len, root)) + tree.verify_positions(root)
    return ForwardItem(request_id, tokens + tree.token_ids, context_len, logit_rows, positions, mask, block_ids)


class ModelRunner:
    def __init__(self, model: DecoderLM, kv: KVCache, device: torch.device, vocab_limit: int | None = None):
        self.model = bind(model, device)  # every layer's route fixed here, for this device
        self.vocab_limit = vocab_limit  # logits over the first `vocab_limit` token ids only (drafts)
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        # keep_hidden: the last forward's final hidden states (after the final norm, every row, in input
        # order) stay in `last_hidden`, for proposers that read the target's features (drafting/head.py)
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        # CUDA: a step's host data (token ids, positions, slots, logit rows, key plan) goes to the device in
        # one non-blocking copy from this pinned buffer; the event says when the last copy has left it
        self._cuda_kernels = cuda_kernels.available(device)
        self._staging: torch.Tensor | None = None
        self.graphs = None  # runtime/backends/cuda/graphs.StepGraphs, made at the first step that can use one
        self._staged: torch.cuda.Event | None = None

    @property
    def _cuda(self) -> bool:
        """Whether this step goes through the CUDA kernels (and so the pinned copy and the key plan)."""
        return self._cuda_kernels and self.model.runtime.cuda_kernels

    def _request_kv(self, block_ids: list[int], length: int) -> tuple[slice | torch.Tensor, np.ndarray | None]:
        """The cache rows of a request's first `length` tokens: a slice (a view, nothing copied) when
        its blocks are consecutive, else the row indices to gather (and their host copy)."""
        first = block_ids[0]
        if all(b == first + i for i, b in enumerate(block_ids)):
            return slice(first * self.block_size, first * self.block_size + length), None
        host = (np.asarray(block_ids, dtype=np.int64)[:, None] * self.block_size
                + np.arange(self.block_size, dtype=np.int64)).ravel()[:length]
        return torch.from_numpy(host).to(self.device, non_blocking=True), host

    def _upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """int64 host arrays -> device tensors, in one copy (CUDA: from a pinned buffer, not waiting)."""
        sizes = [len(a) for a in arrays]
        total = sum(sizes)
        if self.device.type != "cuda":
            flat = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False)) if total else \
                torch.zeros(0, dtype=torch.long, device="cpu")
            return list(flat.to(self.device).split(sizes))
        if self._staged is not None and not self._staged.query():
            self._staged.synchronize()  # the previous step's copy must leave the buffer first (it has, as a rule)
        if self._staging is None or len(self._staging) < total:
            self._staging = torch.empty(max(total, 2 * (0 if self._staging is None else len(self._staging)), 4096),
                                        dtype=torch.long, device="cpu").pin_memory()
        if total:
            np.concatenate(arrays, out=self._staging.numpy()[:total])
        flat = self._staging[:total].to(self.device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return list(flat.split(sizes))

    def execute(self, items: list[ForwardItem], blocks: BlockManager | None = None) -> torch.Tensor:
        """One forward over all items. Returns fp32 logits [sum of len(logit_indices), vocab] in item order.
        Items without a block table take their request's from `blocks`."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_maps, seqs, logit_rows = [], [], []
        offset = 0
        for it in items:
            n = len(it.token_ids)
            total = it.context_len + n
            block_ids = it.block_ids if it.block_ids is not None else blocks.block_ids(it.request_id)
            assert len(block_ids) * self.block_size >= total, "slots must be reserved before a forward"
            kv, host_rows = self._request_kv(block_ids, total)
            if isinstance(kv, slice):
                slot_maps.append(np.arange(kv.start + it.context_len, kv.stop, dtype=np.int64))
            else:
                slot_maps.append(host_rows[it.context_len:])
            seqs.append(self._seq_attention(it, kv, host_rows))
            input_ids.extend(it.token_ids)
            positions.extend(it.positions if it.positions is not None else range(it.context_len, total))
            logit_rows.extend(offset + j for j in it.logit_indices)
            offset += n
        arrays = [np.asarray(input_ids, dtype=np.int64), np.asarray(positions, dtype=np.int64),
                  np.concatenate(slot_maps) if slot_maps else np.zeros(0, np.int64),
                  np.asarray(logit_rows, dtype=np.int64)]
        batch = AttentionBatch(slot_mapping=None, seqs=seqs)
        plan = None
        if self._cuda or self.model.fused_layers is not None:  # the bound backend reads the step's key plan
            batch.key_plan = KeyPlan.build(batch)
        if self._cuda:  # the kernels' copy of the key plan travels with the step's other arrays
            plan = batch.key_plan.arrays()
            if self.model.runtime.cuda_graphs:  # a step shape that repeats: replay its captured graph
                logits = self._step_graph(items, arrays, plan, batch)
                if logits is not None:
                    return logits
        moved = self._upload(arrays + (plan or []))
        ids, pos, batch.slot_mapping, rows = moved[:4]
        if plan is not None:
            batch.plan = cuda_kernels.DevicePlan(*moved[4:])
        hidden = self.model(ids, pos, batch, self.kv)
        self.last_hidden = hidden if self.keep_hidden else None
        return self.model.compute_logits(hidden.index_select(0, rows), self.vocab_limit)

    @property
    def pads_ragged(self) -> bool:
        """Whether a step's requests run at its largest number of new rows (CUDA graphs replay ragged batches
        padded: runtime/backends/cuda/graphs.py), so its cost follows the widest request, not the sum of rows."""
        return self._cuda and bool(self.model.runtime.cuda_graphs)

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far (each at a step that ran its forward three times)."""
        return 0 if self.graphs is None else self.graphs.captures

    def _step_graph(self, items: list[ForwardItem], arrays, plan, batch: AttentionBatch) -> torch.Tensor | None:
        from specfleet.runtime.backends.cuda.graphs import StepGraphs

        if self.graphs is None:
            self.graphs = StepGraphs(self)
        key = self.graphs.shape_of(items)
        if key is None:
            return None
        logits = self.graphs.run(key, len(items), arrays, plan, batch, [len(it.token_ids) for it in items])
        if logits is not None and not self.keep_hidden:
            self.last_hidden = None
        return logits

    def _seq_attention(self, it: ForwardItem, kv: slice | torch.Tensor, host_rows: np.ndarray | None) -> SeqAttention:
        """Split the item's mask into its part over the context (None when all of it is visible) and its
        [n, n] part among the new tokens (None when causal)."""
        n, c = len(it.token_ids), it.context_len
        mask = it.new_mask
        if mask is None:
            return SeqAttention(n, c, kv, host_rows=host_rows)
        # masks are host data: decisions read this copy, never the device's
        host = mask if isinstance(mask, np.ndarray) else mask.cpu().numpy()
        context_mask = host_context = None
        if host.shape[1] == c + n:
            if not host[:, :c].all():
                host_context = host[:, :c].copy()
                context_mask = torch.from_numpy(host_context).to(self.device, non_blocking=True)
            host = host[:, c:]
        host = np.ascontiguousarray(host)  # read-only from here: the CPU tensor may share its memory
        return SeqAttention(n, c, kv, torch.from_numpy(host).to(self.device, non_blocking=True), context_mask,
                            host_mask=host, host_context_mask=host_context, host_rows=host_rows)

    def commit_path(self, blocks: BlockManager, request_id: str, base: int, path: list[int]) -> None:
        """Keep the KV of an accepted tree path: node j of the tree sits at layout index base + j; the
        path's nodes move to base, base + 1, ... (nothing moves when the path is the first nodes in
        order, as for a chain) and everything after them is truncated."""
        if path != list(range(len(path))):
            src, dst = self._upload([np.array([blocks.slot(request_id, base + j) for j in path], dtype=np.int64),
                                     np.array([blocks.slot(request_id, base + i) for i in range(len(path))],
                                              dtype=np.int64)])
            self.kv.copy_slots(src, dst)
        blocks.truncate(request_id, base + len(path))
