"""Continuous batching under a token budget, with preemption by recomputation.

Each step the running requests go first, in arrival order: a request contributes its uncomputed
tokens (one, normally: the last sampled token) plus the nodes of its pending draft tree. Then
waiting requests are admitted, their prompt chunked to fit the remaining budget. When the target
cache has no room, the pending draft is dropped first; then the most recently admitted request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed from
its prompt and the output it already has. Nothing is ever dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specfleet.engine.block_manager import BlockManager
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


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

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

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            num_new = min(req.num_uncomputed, budget)
            with_draft = req.draft is not None and num_new == req.num_uncomputed \
                and num_new + req.num_draft_tokens <= budget
            while True:
                need = num_new + (req.num_draft_tokens if with_draft else 0)
                if self.blocks.can_append(req.request_id, need):
                    break
                if with_draft:
                    with_draft = False
                    continue
                self._preempt(self.running[-1], out)
                if req.status != RequestStatus.RUNNING:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            if not with_draft:
                req.draft = None
            self.blocks.append(req.request_id, num_new + req.num_draft_tokens)
            out.scheduled.append(ScheduledRequest(req, num_new, with_draft))
            budget -= num_new + req.num_draft_tokens
        # admit waiting requests, unless memory was so short that someone was just preempted
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            num_new = min(req.num_uncomputed, budget)
            if not self.blocks.can_allocate(num_new):
                break
            self.waiting.popleft()
            self.blocks.allocate(req.request_id, num_new)
            req.status = RequestStatus.RUNNING
            req.draft = None
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, False))
            budget -= num_new
        return out

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and free its blocks."""
        self.blocks.free(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
