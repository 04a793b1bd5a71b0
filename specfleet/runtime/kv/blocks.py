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

Invariant (tested): free blocks + cached blocks no table holds + distinct blocks held by tables ==
num_blocks, always; `num_free_blocks` counts the first two (a cached block is evicted when needed).

Prefix caching (`enable_caching`). A full block of committed tokens (all of its positions' KV is final:
below the request's computed count) is registered under a content hash chained with the hashes of
the blocks before it, so a hash names the whole prefix up to the block's end. A new request maps the
longest run of registered blocks that starts its tokens (`cached_prefix`; always leaving at least
one token to compute, whose logits the request needs) and computes only the rest. Blocks are shared
by reference count; when the last table holding a registered block lets it go, the block stays
cached (its content intact) and is evicted least recently used when a table needs a block and none
is free. Writes never reach a shared block: a table writes only past its computed tokens, and only
blocks below them are registered; `truncate` into a registered block unregisters it when the table
is its only holder, and keeps fewer tokens (the block's start) when another table shares it. The
hash is a 128-bit BLAKE2b over the token ids, so one client cannot forge another's prefix.

Placement: attention reads a request's keys and values as one view of the cache when its blocks are
consecutive, and must gather them otherwise (runtime/model/attention.py). So a table grows into the block
right after its last one whenever that block is free, and a table that cannot (a new request, or a
neighbour in the way) starts a new run in the largest free gap: at the gap's start when nothing
precedes it, else halfway in, leaving the preceding table room to grow. Rolled-back blocks are
taken again by the same table at its next append, since they follow its last block.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """Raised by allocate/append when the caller did not check can_allocate/can_append first."""


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, num_blocks: int,
                        salt: str | None = None) -> None:
    """Extend `hashes` (the chained hashes of the first full blocks of `token_ids`) to `num_blocks`. A
    request's `salt` (SamplingParams.cache_salt) goes into the first block's hash and so into every later
    one: requests with different salts never share a cached block, and none can learn from its cache hits
    what another client sent (vLLM's cache_salt)."""
    for i in range(len(hashes), num_blocks):
        h = hashlib.blake2b(hashes[i - 1] if i else _salt_seed(salt), digest_size=16)
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        hashes.append(h.digest())


def _salt_seed(salt: str | None) -> bytes:
    return b"" if salt is None else b"salt:" + salt.encode("utf-8", "surrogatepass")


@dataclass
class BlockTable:
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_registered: int = 0  # leading blocks already offered to the prefix cache (see register)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._is_free = bytearray(b"\x01") * num_blocks  # free: no table holds it and it caches nothing
        self._num_free = num_blocks
        self._tables: dict[str, BlockTable] = {}
        self._refs = [0] * num_blocks  # tables holding each block
        self._hash_of: dict[int, bytes] = {}  # registered block -> its prefix hash
        self._block_of: dict[bytes, int] = {}  # prefix hash -> registered block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by no table; LRU first
        # prefix-cache counters: tokens looked up at admission, and how many of them were found cached
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a table can take: free ones plus cached ones no table holds (evicted on demand)."""
        return self._num_free + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks (held or not): the prefix cache's size."""
        return len(self._hash_of)

    @property
    def num_held_blocks(self) -> int:
        """Blocks some live table holds; 0 once every request is gone."""
        return self.num_blocks - self.num_free_blocks

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

    def can_allocate(self, num_tokens: int, cached: list[int] = ()) -> bool:
        """Room for a new table of the `cached` blocks (from cached_prefix) plus `num_tokens` tokens."""
        taken = sum(1 for b in cached if self._refs[b] == 0)  # mapping them takes them out of the pool
        return self.blocks_for(num_tokens + len(cached) * self.block_size) - len(cached) \
            <= self.num_free_blocks - taken

    def can_append(self, request_id: str, num_new_tokens: int) -> bool:
        return self._extra_blocks(request_id, num_new_tokens) <= self.num_free_blocks

    def cached_prefix(self, token_ids: list[int], hashes: list[bytes], salt: str | None = None) -> list[int]:
        """The registered blocks that hold the longest cached prefix of `token_ids`, leaving at least the
        last token uncached. `hashes` is the caller's per-request memo of block hashes (extended here)."""
        if not self.enable_caching:
            return []
        n = (len(token_ids) - 1) // self.block_size
        extend_block_hashes(hashes, token_ids, self.block_size, n, salt)  # also read by the scheduler
        blocks = []
        for h in hashes[:n]:
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    # -- verbs -----------------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, cached: list[int] = ()) -> None:
        """A new table: the `cached` blocks (from cached_prefix, shared) and room for `num_tokens` more."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if not self.can_allocate(num_tokens, cached):
            raise OutOfBlocks(f"need {self.blocks_for(num_tokens)} blocks, {self.num_free_blocks} free")
        table = self._tables[request_id] = BlockTable()
        for b in cached:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        table.block_ids = list(cached)
        table.num_tokens = table.num_registered = len(cached)
        table.num_tokens *= self.block_size
        self.append(request_id, num_tokens)

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def register(self, request_id: str, token_ids: list[int], num_tokens: int, hashes: list[bytes],
                 salt: str | None = None) -> None:
        """Offer the table's full blocks below `num_tokens` (tokens whose KV is final: `token_ids[:num_tokens]`)
        to the prefix cache. A block whose content is already cached under another block stays private."""
        table = self._tables.get(request_id)
        if not self.enable_caching or table is None:
            return
        full = min(num_tokens, len(token_ids), table.num_tokens) // self.block_size
        if full <= table.num_registered:
            return
        extend_block_hashes(hashes, token_ids, self.block_size, full, salt)
        for i in range(table.num_registered, full):
            b, h = table.block_ids[i], hashes[i]
            if b not in self._hash_of and h not in self._block_of:
                self._hash_of[b] = h
                self._block_of[h] = b
        table.num_registered = full

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
        if extra > self.num_free_blocks:
            raise OutOfBlocks(f"need {extra} blocks, {self.num_free_blocks} free")
        for _ in range(extra):
            table.block_ids.append(self._take_block(table.block_ids))
        table.num_tokens += num_new_tokens

    def _take_block(self, block_ids: list[int]) -> int:
        """A free block where Placement puts it, else the least recently used cached block, evicted."""
        if self._num_free:
            block = self._next_block(block_ids)
            self._is_free[block] = 0
            self._num_free -= 1
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self.num_evictions += 1
        self._refs[block] = 1
        return block

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

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Keep the first `num_tokens` tokens; blocks no longer needed are released. Returns the tokens
        kept: `num_tokens`, or fewer (the start of the block) when the cut falls inside a registered
        block another table shares, whose later slots this table must then not overwrite."""
        table = self._tables[request_id]
        if num_tokens > table.num_tokens:
            raise ValueError(f"cannot truncate {request_id!r} from {table.num_tokens} up to {num_tokens} tokens")
        cut = num_tokens // self.block_size
        if num_tokens % self.block_size and cut < len(table.block_ids) and table.block_ids[cut] in self._hash_of:
            block = table.block_ids[cut]
            if self._refs[block] > 1:
                num_tokens = cut * self.block_size
            else:  # ours alone: it stops being a cached prefix, since its tail will be overwritten
                del self._block_of[self._hash_of.pop(block)]
        keep = self.blocks_for(num_tokens)
        while len(table.block_ids) > keep:
            self._release(table.block_ids.pop())
        table.num_tokens = num_tokens
        table.num_registered = min(table.num_registered, num_tokens // self.block_size)
        return num_tokens

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if block in self._hash_of:
            self._evictable[block] = None  # cached, newest last
        else:
            self._is_free[block] = 1
            self._num_free += 1

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table is not None:
            for block in reversed(table.block_ids):  # a prefix's tail is evicted before its head
                self._release(block)

    def clear_cache(self) -> None:
        """Forget every cached block no table holds (they become free)."""
        for block in list(self._evictable):
            del self._block_of[self._hash_of.pop(block)]
            self._is_free[block] = 1
            self._num_free += 1
        self._evictable.clear()

    def slot(self, request_id: str, position: int) -> int:
        table = self._tables[request_id]
        return table.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def check_invariant(self) -> None:
        refs = [0] * self.num_blocks
        for t in self._tables.values():
            assert len(set(t.block_ids)) == len(t.block_ids), "a table holds a block twice"
            for b in t.block_ids:
                refs[b] += 1
        assert refs == self._refs, "reference counts broken"
        held = [b for b in range(self.num_blocks) if refs[b]]
        free = [b for b in range(self.num_blocks) if self._is_free[b]]
        all_ids = held + free + list(self._evictable)
        assert len(free) == self._num_free, "free count broken"
        assert len(all_ids) == self.num_blocks and len(set(all_ids)) == self.num_blocks, "block accounting broken"
        assert all(b in self._hash_of for b in self._evictable), "an uncached block in the cache pool"
        assert {self._block_of[h]: h for h in self._block_of} == self._hash_of, "hash maps disagree"
