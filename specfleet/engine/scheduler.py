"""Continuous batching under a per-step token budget: decode rows first, then prefill chunks.

Each step's budget (`max_num_batched_tokens`) is filled in two passes.

1. Decode and verify rows. Every running request whose sequence is computed up to its last sampled
   token contributes that token plus one row per node of its pending draft tree, in admission order.
   A draft rides along only when it fits the budget and the cache; otherwise it is dropped and the
   request decodes one token.
2. Prefill chunks from what is left. Prompts in prefill are the running requests whose prompt is
   only partly computed (they keep their blocks and counters between steps), then the waiting
   requests, at most `max_num_prefills` prompts in all. The left-over budget is split among them
   max-min fairly (water filling): each gets an equal share, and a prompt that needs less than its
   share takes only what it needs and leaves the rest to the others. Example: 500 tokens left and
   prompts needing 20, 4000 and 3000 tokens get 20, 240 and 240. So a short prompt that arrives
   during a long prefill is prefilled in its next step, and the long one still progresses by at
   least 1/max_num_prefills of the left-over budget per step (decode rows come first: a step whose
   decode rows fill the budget prefills nothing). A partly prefilled request gets no
   draft and emits no token until its last chunk (`ScheduledRequest.completes_sequence`).

Mixed steps: while other requests decode or wait, the prompt chunks of a step are cut further so the
step costs about `mixed_step_factor` decode steps (the engine measures both costs as it runs and
sets `row_cap` before each step; engine/step_costs.py), but each step still prefills at least
MIN_CHUNK tokens. Without anyone else a long prompt takes the whole budget, at full prefill speed.

Bounded steps: with `step_cap` set (the server sets it from the step's time target, engine.py), every
step's prompt chunks are cut to that many rows less its decode rows (at least MIN_CHUNK), a lone
prompt's too: a request that arrives during a long prefill waits only for the short step in flight.

Prefix caching: a waiting request is admitted with the longest cached prefix of its tokens already
computed (runtime/kv/blocks.py), so its chunks, its share of the budget and its admission check
count only the rest; after a preemption it looks again, and usually finds its own blocks. A request
whose first block is the first block of a prompt still being prefilled (the n samples of one prompt,
or clients sharing a system prompt that arrive together) waits until that prefill ends and then maps
it, rather than computing the same prefix beside it.

Memory: when the cache has no room for a decode row, the pending draft is dropped first; then the
most recently admitted request is preempted: its blocks are freed and it goes back to the front of
the queue, to be recomputed from its prompt and the output it already has. Nothing is ever dropped.
A prefill chunk that does not fit waits; if nothing at all fits, the most recently admitted request
is preempted, so half-computed prompts cannot fill the cache and stall one another. No request is
admitted in a step in which someone was preempted.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from specfleet.runtime.kv.blocks import BlockManager
from specfleet.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # committed tokens whose KV is computed this step
    with_draft: bool  # whether the request's draft tree rides along in this forward

    @property
    def completes_sequence(self) -> bool:
        """True when this step reaches the end of the known tokens, so the target must emit a token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


MIN_CHUNK = 16  # prompt tokens a step carries at least, however tight the row cap


def fair_shares(needs: list[int], budget: int) -> list[int]:
    """Max-min fair split of `budget` tokens: fair_shares([20, 4000, 3000], 500) == [20, 240, 240]."""
    shares = [0] * len(needs)
    left = budget
    order = sorted(range(len(needs)), key=lambda i: needs[i])
    for k, i in enumerate(order):
        shares[i] = min(needs[i], left // (len(order) - k))
        left -= shares[i]
    return shares


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_num_prefills: int = 4):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_prefills = max_num_prefills
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._parked: Collection[str] = ()
        self.row_cap: int | None = None  # rows a mixed step may carry (set by the engine each step)
        self.step_cap: int | None = None  # rows any step may carry (set by the engine each step; None: no bound)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.blocks.free(req.request_id)
        req.num_computed_tokens = 0
        req.draft = None
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def schedule(self, parked: Collection[str] = ()) -> SchedulerOutput:
        """One step's batch. `parked` requests (a pipelined engine's, out with their drafters) are
        neither scheduled nor preempted, but hold their places and count against max_num_seqs."""
        self._parked = parked
        out = SchedulerOutput()
        budget = self._schedule_decodes(out)
        budget = self._bounded_step_budget(out, self._mixed_step_budget(out, budget))
        self._schedule_prefills(out, budget)
        while not out.scheduled and self._victim() is not None:  # every chunk is short of blocks: make room
            self._preempt(self._victim(), out)
            self._schedule_prefills(out, budget)
        return out

    def _mixed_step_budget(self, out: SchedulerOutput, budget: int) -> int:
        """The prefill budget, cut to the row cap when the step is shared: decode rows are in it, or
        more than one prompt is in prefill or waiting."""
        if self.row_cap is None:
            return budget
        prompts = sum(1 for r in self.running if r.status == RequestStatus.RUNNING and r.num_uncomputed > 1
                      and r.request_id not in self._parked) + len(self.waiting)
        if not out.scheduled and prompts <= 1:
            return budget  # one prompt alone: full speed
        used = sum(s.num_new_tokens + (s.request.num_draft_tokens if s.with_draft else 0) for s in out.scheduled)
        return min(budget, max(MIN_CHUNK, self.row_cap - used))

    def _bounded_step_budget(self, out: SchedulerOutput, budget: int) -> int:
        """The prefill budget cut to `step_cap` rows in all, shared or not (see the module docstring)."""
        if self.step_cap is None:
            return budget
        used = sum(s.num_new_tokens + (s.request.num_draft_tokens if s.with_draft else 0) for s in out.scheduled)
        return min(budget, max(MIN_CHUNK, self.step_cap - used))

    def _victim(self) -> Request | None:
        """The most recently admitted request that is not parked: the one to preempt."""
        for req in reversed(self.running):
            if req.request_id not in self._parked:
                return req
        return None

    def _schedule_decodes(self, out: SchedulerOutput) -> int:
        """Pass 1: every decoding request's last token and its draft. Returns the budget left."""
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or req.num_uncomputed != 1 or budget == 0 \
                    or req.request_id in self._parked:
                continue
            with_draft = req.draft is not None and 1 + req.num_draft_tokens <= budget
            while True:
                if self.blocks.can_append(req.request_id, 1 + (req.num_draft_tokens if with_draft else 0)):
                    break
                if with_draft:
                    with_draft = False
                    continue
                self._preempt(self._victim(), out)
                if req.status != RequestStatus.RUNNING:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            if not with_draft:
                req.draft = None
            self.blocks.append(req.request_id, 1 + req.num_draft_tokens)
            out.scheduled.append(ScheduledRequest(req, 1, with_draft))
            budget -= 1 + req.num_draft_tokens
        return budget

    def _schedule_prefills(self, out: SchedulerOutput, budget: int) -> None:
        """Pass 2: prompt chunks, the budget shared max-min fairly (see the module docstring)."""
        partial = [r for r in self.running if r.status == RequestStatus.RUNNING and r.num_uncomputed > 1
                   and r.request_id not in self._parked]
        room = min(self.max_num_prefills - len(partial), self.max_num_seqs - len(self.running))
        admissible = [] if out.preempted else list(itertools.islice(self.waiting, max(0, room)))
        candidates = partial[:self.max_num_prefills] + admissible
        needs = [r.num_uncomputed if r.status == RequestStatus.RUNNING else r.num_tokens - self._cached_tokens(r)
                 for r in candidates]
        for req, num_new in zip(candidates, fair_shares(needs, budget)):
            if num_new == 0:
                continue
            if req.status == RequestStatus.RUNNING:
                if self.blocks.can_append(req.request_id, num_new):
                    self.blocks.append(req.request_id, num_new)
                    out.scheduled.append(ScheduledRequest(req, num_new, False))
                continue
            # looked up again: an admission before this one in the step may have evicted part of it
            cached = self._cached_blocks(req)
            if self.waiting[0] is not req or not self.blocks.can_allocate(num_new, cached) \
                    or self._prefix_in_prefill(req, len(cached)):
                break  # admission is in arrival order
            self.waiting.popleft()
            self.blocks.allocate(req.request_id, num_new, cached)
            req.num_computed_tokens = len(cached) * self.blocks.block_size
            self.blocks.count_lookup(req.num_tokens, req.num_computed_tokens)
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            req.draft = None
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, False))

    def _prefix_in_prefill(self, req: Request, num_cached: int) -> bool:
        """Whether a running request still prefilling its prompt starts with the block after `req`'s
        cached ones (so `req` would compute it a second time beside it, instead of mapping it later)."""
        if not self.blocks.enable_caching or not req.uses_prefix_cache or len(req.block_hashes) <= num_cached:
            return False
        h = req.block_hashes[num_cached]
        return any(r.status == RequestStatus.RUNNING and r.num_computed_tokens < len(r.prompt_token_ids)
                   and len(r.block_hashes) > num_cached and r.block_hashes[num_cached] == h for r in self.running)

    def _cached_blocks(self, req: Request) -> list[int]:
        return self.blocks.cached_prefix(req.all_token_ids, req.block_hashes, req.params.cache_salt) \
            if req.uses_prefix_cache else []

    def _cached_tokens(self, req: Request) -> int:
        return len(self._cached_blocks(req)) * self.blocks.block_size

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and free its blocks."""
        self.blocks.free(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
