"""The pipelined engine: drafter threads feed the target through the intermediate result pool.

    engine thread (the target)                      drafter thread i (its own proposer and KV cache)
      take drafted requests from the pool  <-- pool <-- put trees <-- propose(claimed requests)
      schedule them (and any prefills)                                 ^
      forward, verify, commit                                          | claim (back-pressure:
      submit the committed requests         --> pool ------------------+  only while there is room)

Ownership, which is why nothing else needs a lock: a request is either *parked* (submitted and not
yet taken back: only its drafter reads it, and nobody writes its tokens; an abort only marks it
finished, and its draft is discarded when it comes back) or owned by the engine thread,
which alone schedules, verifies, commits and preempts it; the scheduler never sees a parked request.
Each BlockManager has one thread: the target's is the engine thread's; a draft model's is its
drafter thread's, and releases and feedback reach it as messages through the pool, in order.

Overlap: PyTorch releases the GIL inside ops, so a drafter's forward runs while the target's does.
On a GPU each drafter issues its kernels on its own CUDA stream. On the CPU the two share the cores:
`PipelineConfig.target_threads` / `draft_threads` split them (the OpenMP team size is per thread).
Splitting avoids two full-size OpenMP teams oversubscribing the cores, but on a CPU both roles still
compete for the same cores, and the m micro-batches read the target's weights m times per round
(benchmarks/serving/pipeline.py measures it). The overlap pays where drafts and target have their own
compute: GPU streams, or drafts in other processes or devices.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, defaultdict, deque

import torch

from specfleet.config import EngineConfig
from specfleet.engine.engine import Engine, is_fatal
from specfleet.engine.request import Request, RequestStatus
from specfleet.engine.scheduler import SchedulerOutput
from specfleet.errors import InvalidRequestError
from specfleet.outputs import RequestOutput
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.engine.result_pool import (MicroBatchSearch, PipelineConfig, PipelineFailed, PoolEntry, ResultPool,
                                     TargetClock, pipeline_stats, target_batch_size)
from specfleet.core.proposer import Feedback, Proposer, StepTiming, observe_step


class PipelinedEngine(Engine):
    def __init__(self, model: DecoderLM, tokenizer=None, config: EngineConfig | None = None,
                 proposer: Proposer | None = None, device: torch.device | str = "cpu", *,
                 drafters: list[Proposer] | None = None, pipeline: PipelineConfig | None = None):
        drafters = list(drafters or ([] if proposer is None else [proposer]))
        if not drafters:
            raise InvalidRequestError("a pipelined engine needs a draft: pass proposer= or drafters=")
        self.pipeline = pipeline or PipelineConfig()
        self.pipeline.validate()
        super().__init__(model, tokenizer, config, None, device)
        self.pool = ResultPool(len(drafters))
        self.drafters = _DrafterRouter(drafters, self.pool)
        pc = self.pipeline
        self.search = MicroBatchSearch(pc.max_micro_batches, pc.search_window, pc.search_min_gain,
                                       pc.num_micro_batches)
        self.clock = TargetClock()
        self._parked: set[str] = set()
        self._workers = [_DraftWorker(i, p, self.pool, self.device, pc.draft_threads, lambda: self.stats.verify_time,
                                     lambda: self.stats.prompt_rows, lambda: self.stats.warmup_steps,
                                     lambda: self.runner.pads_ragged)
                         for i, p in enumerate(drafters)]
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the drafter threads once they have applied every pending release (so draft caches end
        empty). Remote drafters' processes belong to whoever made them: close those separately."""
        self.pool.close()
        for w in self._workers:
            if w.is_alive():
                w.join(timeout=60)

    def __enter__(self) -> "PipelinedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pipeline_stats(self) -> dict:
        return pipeline_stats(self.clock, self.pool, self.search)

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.pipeline.target_threads is not None:
            torch.set_num_threads(self.pipeline.target_threads)  # the calling (engine) thread's team
        for w in self._workers:
            w.start()

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._start()
        t_enter = time.perf_counter()
        self.pool.set_capacity(self._target_batch())
        num_taken = self._take(wait=False)
        sched = self._schedule()
        if sched.is_empty and self.pool.num_outstanding:
            t_wait = time.perf_counter()  # nothing to verify: the target idles until drafts arrive
            num_taken += self._take(wait=True)
            self.clock.idle_s += time.perf_counter() - t_wait
            sched = self._schedule()
        if sched.is_empty:
            return []
        emitted_before = self.stats.num_emitted
        t_busy = time.perf_counter()
        outputs = self._run(sched)
        self._submit_ready()
        now = time.perf_counter()
        c = self.clock
        c.busy_s += now - t_busy
        c.num_steps += 1
        c.num_emitted += self.stats.num_emitted - emitted_before
        c.num_verified += num_taken
        if c.first_step is None:
            c.first_step = t_enter
        else:
            self.search.record(self.stats.num_emitted - emitted_before, now - c.last_step)
        c.last_step = now
        return outputs

    def _target_batch(self) -> int:
        if self.pipeline.pool_capacity is not None:
            return self.pipeline.pool_capacity
        sch = self.scheduler
        return target_batch_size(min(len(sch.running) + len(sch.waiting), sch.max_num_seqs), self.search.m)

    def _take(self, wait: bool) -> int:
        """Move drafted requests from the pool back to the engine; returns how many came back."""
        entries = self.pool.take(self.pool.capacity, sample=not wait)
        while wait and not entries and self.pool.num_outstanding:
            if not all(w.is_alive() for w in self._workers):
                raise PipelineFailed("a drafter thread is gone")
            entries = self.pool.take(self.pool.capacity, wait_s=0.5, sample=False)
        failed: dict[Exception, list[Request]] = {}  # one failed propose() call -> its requests
        for e in entries:
            self._accept(e)
            if e.error is not None:
                failed.setdefault(e.error, []).append(e.request)
        for error, requests in failed.items():
            self._draft_failed([r for r in requests if self.requests.get(r.request_id) is r], "propose", error)
        for w in self._workers:
            while w.failures:  # a message that raised on the drafter: its requests stop drafting too
                call, request_ids, error = w.failures.popleft()
                affected = [r for rid in request_ids if (r := self.requests.get(rid)) is not None]
                self._draft_failed(affected, call, error)
        return len(entries)

    def _accept(self, e: PoolEntry) -> None:
        req = e.request
        self._parked.discard(req.request_id)
        self.stats.draft_time += e.draft_time
        is_current = (self.requests.get(req.request_id) is req and req.status == RequestStatus.RUNNING
                      and req.num_tokens == e.num_tokens and req.num_uncomputed == 1)
        if not is_current:  # finished or aborted while drafted: the draft is stale
            return
        req.stats.draft_time += e.draft_time
        room = self.max_model_len - req.num_tokens  # never verify past the context
        if e.tree is not None and len(e.tree) and room > 0:
            req.draft = e.tree if len(e.tree) <= room else e.tree.truncated(room)

    def _schedule(self) -> SchedulerOutput:
        """Schedule with the parked requests held out (they are out with their drafters)."""
        self._set_row_cap()
        out = self.scheduler.schedule(parked=self._parked)
        for req in out.preempted:
            self.drafters.release(req.request_id)
        return out

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Forward, verify, commit (the shared StepExecutor), then feedback; drafter threads propose. A step
        that raises fails only its own requests, as in the plain engine (Engine.step)."""
        try:
            outputs, feedback = self.executor.execute(sched)
        except BaseException as e:  # noqa: BLE001 - see Engine.step
            if is_fatal(e):
                raise
            raise self._step_failed(sched, e) from e
        if feedback:
            self.drafters.observe(feedback)
        self.drafters.end_step()
        return outputs

    @property
    def draft_source(self) -> Proposer:
        return self.drafters.drafters[0]

    def _release_draft(self, request_id: str) -> None:
        self.drafters.release(request_id)  # a message to the drafter that owns the request

    def _submit_ready(self) -> None:
        """Park every request whose verification is committed and hand it to its drafter."""
        for r in self.scheduler.running:
            if (r.status == RequestStatus.RUNNING and r.num_uncomputed == 1 and r.draft is None
                    and r.speculate and r.request_id not in self._parked):
                self._parked.add(r.request_id)
                self.pool.submit(self.drafters.drafter_for(r.request_id), r)

    def _finish(self, req: Request) -> None:
        super()._finish(req)  # releases through _release_draft, i.e. a message to the drafter
        self._parked.discard(req.request_id)


class _DrafterRouter:
    """The engine's handle on its drafters: observe/release become messages through the pool to the
    drafter that owns the request (sticky, so a request's draft KV stays in one cache)."""

    def __init__(self, drafters: list[Proposer], pool: ResultPool):
        self.drafters = drafters
        self.pool = pool
        self._owner: dict[str, int] = {}
        self._released: dict[str, int] = {}  # released this step: their last feedback still goes out

    def drafter_for(self, request_id: str) -> int:
        d = self._owner.get(request_id)
        if d is None:
            load = Counter(self._owner.values())
            d = self._owner[request_id] = min(range(len(self.drafters)), key=lambda i: load[i])
        return d

    def observe(self, feedback: list[Feedback]) -> None:
        by_drafter: dict[int, list[Feedback]] = defaultdict(list)
        for fb in feedback:
            d = self._owner.get(fb.request_id, self._released.get(fb.request_id))
            if d is not None:
                by_drafter[d].append(fb)
        for d, fbs in by_drafter.items():
            self.pool.notify(d, "observe", fbs)

    def release(self, request_id: str) -> None:
        self.pool.withdraw(request_id)
        d = self._owner.pop(request_id, None)
        if d is not None:
            self._released[request_id] = d
            self.pool.notify(d, "release", request_id)

    def end_step(self) -> None:
        self._released.clear()


class _DraftWorker(threading.Thread):
    def __init__(self, index: int, proposer: Proposer, pool: ResultPool, device: torch.device,
                 num_threads: int | None, verify_seconds=lambda: 0.0, prompt_rows=lambda: 0, warmups=lambda: 0,
                 pads_ragged=lambda: False):
        super().__init__(name=f"specfleet-drafter-{index}", daemon=True)
        self.index, self.proposer, self.pool, self.device, self.num_threads = index, proposer, pool, device, num_threads
        # the engine's clock for this drafter's proposer, as Engine._propose hands it (core/proposer.StepTiming):
        # when this drafter's last drafting ended, how long it took, and the engine's verify seconds total then
        # (a float the engine thread adds to; reading it here needs no lock)
        self.verify_seconds, self.prompt_rows, self.warmups = verify_seconds, prompt_rows, warmups
        self.pads_ragged = pads_ragged
        self._drafted_at: float | None = None
        self._draft_s = self._verify_at = 0.0
        self._prompt_rows_at = self._warmups_at = 0
        # (call, request ids, error) of observe/release messages that raised, for the engine thread to apply
        # (Engine._draft_failed); a deque, so appending here and popping there need no lock
        self.failures: deque[tuple[str, list[str], Exception]] = deque()

    def run(self) -> None:
        try:
            if self.num_threads is not None:
                torch.set_num_threads(self.num_threads)  # this thread's OpenMP team; the target keeps its own
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while (claim := self.pool.claim(self.index)) is not None:
                    for kind, payload in claim.messages:
                        self._deliver(kind, payload)
                    if claim.requests:
                        self._draft(claim.requests, stream)
        except BaseException as e:  # noqa: BLE001 - handed to the engine thread, which re-raises it
            self.pool.fail(e)

    def _deliver(self, kind: str, payload) -> None:
        try:
            if kind == "observe":
                self.proposer.observe(payload)
            else:
                self.proposer.release(payload)
        except Exception as e:  # noqa: BLE001 - the engine thread turns these requests to plain decoding
            self.failures.append((kind, [fb.request_id for fb in payload] if kind == "observe" else [payload], e))

    def _draft(self, requests: list[Request], stream) -> None:
        lengths = [r.num_tokens for r in requests]  # parked: nobody changes them while we draft
        t0 = time.perf_counter()
        try:
            if self._drafted_at is not None:
                verified = self.verify_seconds()
                observe_step(self.proposer, StepTiming(t0 - self._drafted_at, self._draft_s,
                                                       verified - self._verify_at, len(requests),
                                                       self.prompt_rows() - self._prompt_rows_at,
                                                       self.warmups() - self._warmups_at, self.pads_ragged()))
            trees, error = self.proposer.propose(requests), None
        except Exception as e:  # noqa: BLE001 - the engine thread turns these requests to plain decoding
            trees, error = {}, e
        if stream is not None:
            stream.synchronize()  # tree tensors (draft probabilities) are read on the target's stream
        dt = time.perf_counter() - t0
        self._drafted_at, self._draft_s, self._verify_at = t0 + dt, dt, self.verify_seconds()
        self._prompt_rows_at, self._warmups_at = self.prompt_rows(), self.warmups()
        share = dt / len(requests)
        self.pool.put(self.index, [PoolEntry(r, trees.get(r.request_id), n, self.index, share, error)
                                   for r, n in zip(requests, lengths)], dt)
