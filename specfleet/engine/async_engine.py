"""The engine on a background thread, feeding one asyncio stream per request (for the server).

`Engine` is not thread-safe, so exactly one thread (the *engine thread*) ever calls it. The event
loop talks to that thread through a thread-safe command queue (add / abort / stop); the engine
thread hands outputs back with `loop.call_soon_threadsafe`, once per step for the whole batch.

    loop thread                         engine thread
    generate() -> commands.put(Add)     drain commands -> engine.add_request / abort
    await per-request asyncio.Queue  <- call_soon_threadsafe(deliver, outputs of this step)

Invariants:
- a request that stops being consumed (cancelled task, client gone, generator closed) is aborted;
  the abort is handled before the next step, so its KV blocks are free within one step;
- admission is bounded: at most `max_queue` requests may wait for their first token;
- an exception in `Engine.step` is fatal and loud: it is logged, every in-flight stream raises
  `EngineDeadError`, and later calls are refused (the server reports 503 and /health fails).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Mapping

from specfleet.core.proposer import DraftStats, DraftWeights, speculation_length
from specfleet.engine.engine import Engine
from specfleet.errors import InvalidRequestError, SpecfleetError
from specfleet.outputs import RequestOutput
from specfleet.sampling_params import SamplingParams
from specfleet.core.stats import SpecStats

logger = logging.getLogger("specfleet.engine")


class QueueFullError(SpecfleetError):
    """Too many requests are waiting for their first token; the client should retry later (HTTP 429)."""


class EngineUnavailableError(SpecfleetError):
    """The engine is shutting down or has failed and accepts no requests (HTTP 503)."""


class EngineDeadError(EngineUnavailableError):
    """Engine.step raised; the engine's state is unknown, so it serves nothing more."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state for /metrics, copied on the engine thread after every step; readers on other
    threads only ever see a complete, immutable snapshot (published by one attribute swap)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_engine_steps: int = 0
    # the target's prefix cache (runtime/block_manager.py): its size and lookups since the start
    num_cached_blocks: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_evictions: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    # from the proposer's optional capabilities (core/proposer.py); server/metrics.py interprets them
    draft_weights: Mapping[str, object] = field(default_factory=dict)
    draft_stats: Mapping[str, object] = field(default_factory=dict)
    num_speculative_tokens: int | None = None  # the current length (an adaptive controller's choice)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:  # abort everything still in the engine, then leave the thread
    pass


_Command = _Add | _Abort | _Stop


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue: int = 256):
        if max_queue < 1:
            raise InvalidRequestError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None  # set once, by the engine thread, when step() fails
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}  # loop thread only
        self._queued: set[str] = set()  # admitted, no output delivered yet (waiting + pending); loop thread only
        self._is_accepting = False
        self._idle = asyncio.Event()  # set while no stream is open; used by shutdown()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._num_steps = 0  # engine thread only

    # -- lifecycle (loop thread) -------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name="specfleet-engine", daemon=True)
        self._is_accepting = True
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self._is_accepting and self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to `timeout_s`, abort the rest, stop."""
        self._is_accepting = False
        if self._thread is None:
            return
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            logger.warning("shutdown: aborting %d request(s) still running after %.0fs",
                           len(self._streams), timeout_s)
        self._commands.put(_Stop())
        # the engine thread is finishing a step at most; do not block the loop while it does
        await asyncio.to_thread(self._thread.join, 60.0)
        for q in self._streams.values():  # their requests were aborted by _Stop
            q.put_nowait(EngineUnavailableError("the server shut down before this request finished"))

    # -- requests (loop thread) --------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> "RequestStream":
        """Admit a request and return its stream of cumulative outputs (the last one has finished=True).

        Admission is checked here, synchronously, so a caller can answer 429/503 before it starts a
        response. Errors found by the engine itself (bad prompt) are raised from the iterator.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine failed and serves no more requests: {self.error!r}")
        if not self._is_accepting:
            raise EngineUnavailableError("the server is shutting down and accepts no new requests")
        if len(self._queued) >= self.max_queue:
            raise QueueFullError(f"{len(self._queued)} requests are already waiting (max_queue={self.max_queue}); "
                                 f"retry later")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        queue_: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue_
        self._queued.add(request_id)
        self._idle.clear()
        self._commands.put(_Add(request_id, list(prompt_token_ids), params))
        return RequestStream(self, request_id, queue_)

    def _release(self, request_id: str, abort: bool) -> None:
        """A stream is done with: forget it, and abort its request unless it finished."""
        self._queued.discard(request_id)
        self._streams.pop(request_id, None)
        if abort:
            self._commands.put(_Abort(request_id))
        if not self._streams:
            self._idle.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Runs on the loop thread: route each output to its stream (aborted streams are gone)."""
        for out in outputs:
            self._queued.discard(out.request_id)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _deliver_error(self, request_id: str | None, error: BaseException) -> None:
        targets = list(self._streams.values()) if request_id is None else [self._streams.get(request_id)]
        for stream in targets:
            if stream is not None:
                stream.put_nowait(error)

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not self._handle_commands(block=not self.engine.has_unfinished()):
                    break
                outputs: list[RequestOutput] = []
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._num_steps += 1
                self._publish_snapshot()
                if outputs:
                    self._call_in_loop(self._deliver, outputs)
        except BaseException as e:  # noqa: BLE001 -- the thread must report every failure, then die
            logger.exception("engine step failed; the engine stops serving")
            self.error = e
            self._call_in_loop(self._deliver_error, None,
                               EngineDeadError(f"the engine failed while running this request: {e!r}"))
        finally:
            self._abort_all()
            self._publish_snapshot()

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; with `block`, sleep until one arrives. False once asked to stop."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Abort):
                self.engine.abort(cmd.request_id)
            else:
                self._add(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.prompt_token_ids, cmd.params, cmd.request_id)
        except Exception as e:  # noqa: BLE001 -- a bad request fails alone; the engine state is unchanged
            if not isinstance(e, SpecfleetError):
                logger.exception("add_request(%s) failed", cmd.request_id)
            self._call_in_loop(self._deliver_error, cmd.request_id, e)

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 -- best effort after a failure; already logged above
                logger.exception("abort(%s) failed during engine stop", request_id)

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to read the result
            pass

    def _publish_snapshot(self) -> None:
        eng = self.engine
        stats = SpecStats()
        stats.merge(eng.stats)  # a copy: the engine keeps mutating its own
        proposer = eng.draft_source
        self.snapshot = EngineSnapshot(
            num_running=len(eng.scheduler.running), num_waiting=len(eng.scheduler.waiting),
            num_free_blocks=eng.blocks.num_free_blocks, num_blocks=eng.blocks.num_blocks,
            num_engine_steps=self._num_steps, stats=stats, num_cached_blocks=eng.blocks.num_cached_blocks,
            prefix_queried_tokens=eng.blocks.num_queried_tokens, prefix_hit_tokens=eng.blocks.num_hit_tokens,
            prefix_evictions=eng.blocks.num_evictions,
            draft_weights=_copy_map(proposer.weights) if isinstance(proposer, DraftWeights) else {},
            draft_stats=_copy_map(proposer.draft_stats) if isinstance(proposer, DraftStats) else {},
            num_speculative_tokens=speculation_length(proposer))


class RequestStream:
    """One request's cumulative outputs, as an async iterator; the last output has finished=True.

    Closing it early (`aclose()`, or cancelling the task awaiting the next output) aborts the
    request. Unlike an async generator, `aclose()` works even if iteration never started, so a
    response that is cancelled before its first read still frees the request.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, outputs: asyncio.Queue):
        self.request_id = request_id
        self._owner = owner
        self._outputs = outputs
        self._is_closed = False
        self._is_finished = False
        self.error: BaseException | None = None  # what ended the stream, if the engine failed it

    @property
    def is_finished(self) -> bool:
        return self._is_finished

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._is_closed:
            raise StopAsyncIteration
        try:
            items = [await self._outputs.get()]
        except BaseException:  # the consumer was cancelled: abort
            await self.aclose()
            raise
        while not self._outputs.empty():  # outputs are cumulative: a slow reader skips to the newest
            items.append(self._outputs.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                self.error = item
                await self.aclose()
                raise item
        out: RequestOutput = items[-1]
        if out.finished:
            self._is_finished = True
            await self.aclose()
        return out

    async def aclose(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            self._owner._release(self.request_id, abort=not self._is_finished)


def _copy_map(value: Mapping) -> dict[str, object]:
    """A shallow copy of a proposer's `weights` or `draft_stats` mapping."""
    return {str(k): v for k, v in value.items()}
