"""Runs one model over a ragged batch: builds positions, slot mappings and masks, returns logits.

This is the only layer between the engine's bookkeeping and the device. It owns the model and its
KV cache tensors; block ownership comes in from a BlockManager.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specfleet.engine.block_manager import BlockManager
from specfleet.runtime.attention import AttentionBatch, build_visibility_mask, causal_mask
from specfleet.runtime.kv_cache import KVCache
from specfleet.runtime.model import DecoderLM


@dataclass
class ForwardItem:
    """One request's share of a forward pass.

    The new tokens occupy KV layout indices [context_len, context_len + n). Their rotary positions
    default to the same indices; a draft tree passes `positions` = context_len + depth instead,
    because siblings sit side by side in the layout but share a position.
    """

    request_id: str
    token_ids: list[int]
    context_len: int
    logit_indices: list[int]  # which of the new tokens need logits, relative to the first new token
    positions: list[int] | None = None
    # bool visibility of the new tokens: [n, n] over the new tokens (the whole context is visible),
    # or [n, context_len + n] when part of the context must stay hidden (a tree drafted level by level)
    new_mask: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: DecoderLM, kv: KVCache, device: torch.device, vocab_limit: int | None = None):
        self.model = model
        self.vocab_limit = vocab_limit  # logits over the first `vocab_limit` token ids only (drafts)
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self._block_offsets = torch.arange(kv.block_size, device=device)

    def _request_slots(self, block_ids: list[int], length: int) -> torch.Tensor:
        bt = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return (bt[:, None] * self.block_size + self._block_offsets).flatten()[:length]

    def execute(self, items: list[ForwardItem], blocks: BlockManager) -> torch.Tensor:
        """One forward over all items. Returns fp32 logits [sum of len(logit_indices), vocab] in item order."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_maps, kv_indices, masks, logit_rows = [], [], [], []
        offset = 0
        for it in items:
            n = len(it.token_ids)
            total = it.context_len + n
            assert blocks.num_tokens(it.request_id) >= total, "scheduler must reserve slots before a forward"
            slots = self._request_slots(blocks.block_ids(it.request_id), total)
            slot_maps.append(slots[it.context_len:])
            kv_indices.append(slots)
            if n == 1 and (it.new_mask is None or bool(it.new_mask.all())):
                masks.append(None)  # a single new token sees the whole sequence
            else:
                m = it.new_mask.to(self.device) if it.new_mask is not None else causal_mask(n, self.device)
                masks.append(m if m.shape[1] == total else build_visibility_mask(it.context_len, m))
            input_ids.extend(it.token_ids)
            positions.extend(it.positions if it.positions is not None else range(it.context_len, total))
            logit_rows.extend(offset + j for j in it.logit_indices)
            offset += n
        batch = AttentionBatch(
            query_lens=[len(it.token_ids) for it in items],
            context_lens=[it.context_len for it in items],
            slot_mapping=torch.cat(slot_maps),
            kv_indices=kv_indices,
            masks=masks,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, batch, self.kv)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows), self.vocab_limit)
