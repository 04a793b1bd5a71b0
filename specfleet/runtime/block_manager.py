"""Paged KV bookkeeping: which fixed-size blocks each request owns. No device code.

Every cache (the target's and each draft model's) has its own BlockManager. A request's table maps
its token positions to slots: position p lives in slot `table[p // block_size] * block_size +
p % block_size`. The verbs are symmetric:

    can_allocate / allocate   a request's first `n` tokens
    can_append / append       `n` more tokens at the end (a decode step, or a draft tree to verify)
    reserve                   `n` more tokens, allocating the table if the request has none;
                              False (and nothing changes) when the blocks are not there
    truncate                  keep only the first `n` tokens (speculative rollback), freeing blocks
    free                      drop the request entirely

Invariant (tested): num_free_blocks + sum of blocks held by tables == num_blocks, always.

Placement: attention reads a request's keys and values as one view of the cache when its blocks are
consecutive, and must gather them otherwise (runtime/attention.py). So a table grows into the block
right after its last one whenever that block is free, and a table that cannot (a new request, or a
neighbour in the way) starts a new run in the largest free gap: at the gap's start when nothing
precedes it, else halfway in, leaving the preceding table room to grow. Rolled-back blocks are
taken again by the same table at its next append, since they follow its last block.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """Raised by allocate/append when the caller did not check can_allocate/can_append first."""


@dataclass
class BlockTable:
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._is_free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._tables: dict[str, BlockTable] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def num_tokens(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        return 0 if table is None else table.num_tokens

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables[request_id].block_ids

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _extra_blocks(self, request_id: str, num_new_tokens: int) -> int:
        table = self._tables.get(request_id)
        have = 0 if table is None else len(table.block_ids)
        need = self.blocks_for((0 if table is None else table.num_tokens) + num_new_tokens)
        return max(0, need - have)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self._num_free

    def can_append(self, request_id: str, num_new_tokens: int) -> bool:
        return self._extra_blocks(request_id, num_new_tokens) <= self._num_free

    # -- verbs -----------------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> None:
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        self._tables[request_id] = BlockTable()
        try:
            self.append(request_id, num_tokens)
        except OutOfBlocks:
            del self._tables[request_id]
            raise

    def reserve(self, request_id: str, num_new_tokens: int) -> bool:
        """Allocate-or-append in one call: room for `num_new_tokens` more tokens, or False."""
        if request_id not in self._tables:
            if not self.can_allocate(num_new_tokens):
                return False
            self.allocate(request_id, num_new_tokens)
            return True
        if not self.can_append(request_id, num_new_tokens):
            return False
        self.append(request_id, num_new_tokens)
        return True

    def append(self, request_id: str, num_new_tokens: int) -> None:
        """Reserve slots for `num_new_tokens` more tokens of an existing request."""
        table = self._tables[request_id]
        extra = self._extra_blocks(request_id, num_new_tokens)
        if extra > self._num_free:
            raise OutOfBlocks(f"need {extra} blocks, {self._num_free} free")
        for _ in range(extra):
            block = self._next_block(table.block_ids)
            self._is_free[block] = 0
            self._num_free -= 1
            table.block_ids.append(block)
        table.num_tokens += num_new_tokens

    def _next_block(self, block_ids: list[int]) -> int:
        """The block a table grows into (see Placement above); there is at least one free block."""
        if block_ids and block_ids[-1] + 1 < self.num_blocks and self._is_free[block_ids[-1] + 1]:
            return block_ids[-1] + 1
        start, length = max(self._free_runs(), key=lambda run: run[1])
        return start if start == 0 else start + length // 2  # a held block precedes every other run

    def _free_runs(self):
        """(start, length) of each maximal run of free blocks, in block order."""
        flags = self._is_free
        i, n = flags.find(1), self.num_blocks
        while i != -1:
            end = flags.find(0, i)
            end = n if end == -1 else end
            yield i, end - i
            i = flags.find(1, end) if end < n else -1

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens; blocks no longer needed go back to the free list."""
        table = self._tables[request_id]
        if num_tokens > table.num_tokens:
            raise ValueError(f"cannot truncate {request_id!r} from {table.num_tokens} up to {num_tokens} tokens")
        keep = self.blocks_for(num_tokens)
        while len(table.block_ids) > keep:
            self._release(table.block_ids.pop())
        table.num_tokens = num_tokens

    def _release(self, block: int) -> None:
        self._is_free[block] = 1
        self._num_free += 1

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table is not None:
            for block in table.block_ids:
                self._release(block)

    def slot(self, request_id: str, position: int) -> int:
        table = self._tables[request_id]
        return table.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def check_invariant(self) -> None:
        held = [b for t in self._tables.values() for b in t.block_ids]
        free = [b for b in range(self.num_blocks) if self._is_free[b]]
        all_ids = held + free
        assert len(free) == self._num_free, "free count broken"
        assert len(all_ids) == self.num_blocks and len(set(all_ids)) == self.num_blocks, "block accounting broken"
