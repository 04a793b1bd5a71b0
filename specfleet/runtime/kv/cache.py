"""Device memory for a paged KV cache: one key and one value tensor per layer, indexed by flat slot.

Slot s belongs to block s // block_size. The bookkeeping of which request owns which block lives in
`specfleet.runtime.kv.blocks`; this module only sizes and holds the tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specfleet.errors import InvalidRequestError
from specfleet.runtime.model.config import ModelConfig


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem


def num_blocks_for_budget(cfg: ModelConfig, dtype: torch.dtype, budget_bytes: int, block_size: int) -> int:
    n = budget_bytes // (bytes_per_token(cfg, dtype) * block_size)
    if n < 1:
        raise InvalidRequestError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {block_size} tokens; raise kv_cache_bytes"
        )
    return int(n)


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [num_blocks * block_size, num_kv_heads, head_dim]
    v: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> "KVCache":
        shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        return cls(k, v, block_size)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0] // self.block_size

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V from slots `src` to slots `dst` in every layer (used to compact an accepted tree path)."""
        for k, v in zip(self.k, self.v):
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))
