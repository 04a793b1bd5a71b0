"""The engine on a background thread, feeding one asyncio stream per request (for the server).

`Engine` is not thread-safe, so exactly one thread (the *engine thread*) ever calls it. The event
loop talks to that thread through a thread-safe command queue (add / abort / stop); the engine
thread hands outputs back with `loop.call_soon_threadsafe`, once per step for the whole batch.

    loop thread                         engine thread
    generate() -> commands.put(Add)     drain commands -> engine.add_request / abort
    await per-request bounded buffer <- call_soon_threadsafe(deliver, deltas of this step)

What crosses over is a *delta* per request and step (the tokens, origins and log-probabilities new
since the last one, and the text as "keep k characters, then append s": stop strings and completed
UTF-8 characters can change the text's tail), not the whole output so far. Each stream's buffer holds
at most `stream_buffer` deltas; when it is full the newest ones are merged into its last, so a slow
reader costs memory in proportion to its output, never to output x steps. A reader that leaves its
buffer full for longer than `stream_stall_timeout_s` is too far behind: its request is aborted (its
KV blocks freed) and its stream ends with `StreamStalledError`; the engine and the other streams go
on. The stream reassembles the deltas, so a reader still sees cumulative `RequestOutput`s.

Invariants:
- a request that stops being consumed (cancelled task, client gone, generator closed) is aborted;
  the abort is handled before the next step, so its KV blocks are free within one step;
- admission is bounded: at most `max_queue` requests may wait for their first token;
- one step's failure is its requests' own: when a step's forward, verification or commit raises, the
  engine aborts the requests in that step (`StepFailedError`, engine.py), their streams raise
  `RequestFailedError`, and the engine goes on;
- a fatal error is loud and final: an error outside a step's batch (scheduling, bookkeeping), one that
  poisons the process or the device (`engine.is_fatal`), or `max_step_failures` failed steps in a
  row. It is logged, every in-flight stream raises `EngineDeadError`, later calls are refused (the
  server reports 503) and `/health` gives `death_reason`.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from specfleet.core.proposer import DraftStats, DraftWeights, speculation_length
from specfleet.engine.engine import Engine, StepFailedError
from specfleet.errors import InvalidRequestError, SpecfleetError
from specfleet.outputs import OutputDelta, RequestOutput, SentOutput, TokenLogprob  # noqa: F401 -- OutputDelta: re-exported
from specfleet.runtime.kv.blocks import BlockManager
from specfleet.runtime.sample.structured import Matcher
from specfleet.sampling_params import SamplingParams
from specfleet.core.stats import SpecStats

logger = logging.getLogger("specfleet.engine")


SERVING_STEP_S = 0.2  # about the longest step while serving: a short request's first token behind a long
# prefill then waits for at most about this (the step in flight) plus its own short step


class QueueFullError(SpecfleetError):
    """Too many requests are waiting for their first token; the client should retry later (HTTP 429)."""


class EngineUnavailableError(SpecfleetError):
    """The engine is shutting down or has failed and accepts no requests (HTTP 503)."""


class EngineDeadError(EngineUnavailableError):
    """Engine.step raised; the engine's state is unknown, so it serves nothing more."""


class RequestFailedError(SpecfleetError):
    """The engine step that ran this request failed; the request was stopped, the engine goes on (HTTP 500)."""


class StreamStalledError(SpecfleetError):
    """The reader of this stream fell too far behind; its request was stopped to bound the server's memory."""


def num_held_blocks(blocks: BlockManager) -> int:
    """KV blocks held by live requests: 0 once every request has ended, else blocks leaked (the soak
    test's and /metrics' leak check). Cached prefix blocks that no request holds do not count (they are
    evictable, BlockManager.num_held_blocks)."""
    return blocks.num_held_blocks


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state for /metrics, copied on the engine thread after every step; readers on other
    threads only ever see a complete, immutable snapshot (published by one attribute swap)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_engine_steps: int = 0
    # the target's prefix cache (runtime/kv/blocks.py): its size and lookups since the start
    num_cached_blocks: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_evictions: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    # from the proposer's optional capabilities (core/proposer.py); server/metrics.py interprets them
    draft_weights: Mapping[str, object] = field(default_factory=dict)
    draft_stats: Mapping[str, object] = field(default_factory=dict)
    num_speculative_tokens: int | None = None  # the current length (an adaptive controller's choice)
    num_held_blocks: int = 0  # KV blocks held by live requests (num_held_blocks)
    num_requests: int = 0  # requests the engine tracks (running, waiting or between the two)
    num_step_failures: int = 0  # steps whose batch failed (StepFailedError)
    num_failed_requests: int = 0  # requests stopped by those failures


def to_delta(out: RequestOutput, sent: SentOutput) -> OutputDelta:
    """The part of cumulative `out` not in `sent` (engine thread); updates `sent`."""
    return sent.delta(out.request_id, out.text, out.token_ids, out.token_origins, out.logprobs, out.prompt_logprobs,
                      out.finished, out.finish_reason, out.metrics)


class _StreamBuffer:
    """Loop thread: one stream's deltas, at most `capacity` of them, then an optional terminal error."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: deque[OutputDelta] = deque()
        self.error: BaseException | None = None
        self.full_since: float | None = None  # when the buffer last became full (None: it is not)
        self._ready = asyncio.Event()

    def put(self, delta: OutputDelta, now: float) -> None:
        if len(self.items) < self.capacity:
            self.items.append(delta)
        else:
            self.items[-1].merge(delta)
            if self.full_since is None:
                self.full_since = now
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._ready.set()

    async def take(self) -> tuple[list[OutputDelta], BaseException | None]:
        """Everything buffered (waiting for something first)."""
        while not self.items and self.error is None:
            self._ready.clear()
            await self._ready.wait()
        items = list(self.items)
        self.items.clear()
        self.full_since = None
        return items, self.error


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: Matcher | None = None  # built off the engine thread (Engine.add_request)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:  # abort everything still in the engine, then leave the thread
    pass


_Command = _Add | _Abort | _Stop


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue: int = 256, stream_buffer: int = 64,
                 stream_stall_timeout_s: float = 30.0, max_step_failures: int = 3,
                 max_step_s: float | None = SERVING_STEP_S):
        if max_queue < 1:
            raise InvalidRequestError(f"max_queue must be >= 1, got {max_queue}")
        if stream_buffer < 1:
            raise InvalidRequestError(f"stream_buffer must be >= 1, got {stream_buffer}")
        if not stream_stall_timeout_s >= 0:
            raise InvalidRequestError(f"stream_stall_timeout_s must be >= 0, got {stream_stall_timeout_s}")
        if max_step_failures < 1:
            raise InvalidRequestError(f"max_step_failures must be >= 1, got {max_step_failures}")
        self.engine = engine
        # a served engine bounds each step's time: a request can arrive at any moment, and it waits for the
        # step in flight (a lone long prompt's too) before its own first step (Engine.max_step_s)
        engine.max_step_s = max_step_s
        self.max_queue = max_queue
        self.stream_buffer = stream_buffer
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.max_step_failures = max_step_failures
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None  # set once, by the engine thread, when the engine dies
        self.death_reason: str | None = None  # why, in words (for /health)
        self.num_stalled_streams = 0  # streams stopped because their reader fell behind (loop thread)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _StreamBuffer] = {}  # loop thread only
        self._sent: dict[str, SentOutput] = {}  # engine thread only
        self._num_step_failures = 0  # engine thread only
        self._num_failed_requests = 0
        self._failures_in_a_row = 0
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
        for buf in self._streams.values():  # their requests were aborted by _Stop
            buf.fail(EngineUnavailableError("the server shut down before this request finished"))

    # -- requests (loop thread) --------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 grammar: Matcher | None = None) -> "RequestStream":
        """Admit a request and return its stream of cumulative outputs (the last one has finished=True).
        `grammar`: the request's matcher, compiled by the caller off the engine thread (the engine
        thread steps every request, so it compiles nothing a client sent when it is given).

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
        buf = _StreamBuffer(self.stream_buffer)
        self._streams[request_id] = buf
        self._queued.add(request_id)
        self._idle.clear()
        prompt = list(prompt_token_ids)
        self._commands.put(_Add(request_id, prompt, params, grammar))
        return RequestStream(self, request_id, buf, prompt)

    def _release(self, request_id: str, abort: bool) -> None:
        """A stream is done with: forget it, and abort its request unless it finished."""
        self._queued.discard(request_id)
        self._streams.pop(request_id, None)
        if abort:
            self._commands.put(_Abort(request_id))
        if not self._streams:
            self._idle.set()

    def _deliver(self, deltas: list[OutputDelta]) -> None:
        """Runs on the loop thread: route each delta to its stream (aborted streams are gone), and stop
        the requests whose reader left its buffer full for too long."""
        now = time.monotonic()
        for delta in deltas:
            self._queued.discard(delta.request_id)
            buf = self._streams.get(delta.request_id)
            if buf is None:
                continue
            buf.put(delta, now)
            if buf.full_since is not None and now - buf.full_since > self.stream_stall_timeout_s \
                    and not delta.finished:
                self._stall(delta.request_id, buf, now - buf.full_since)

    def _stall(self, request_id: str, buf: _StreamBuffer, seconds: float) -> None:
        self.num_stalled_streams += 1
        logger.warning("stream %s: its reader took nothing for %.1f s with %d outputs waiting; the request is "
                       "stopped", request_id, seconds, buf.capacity)
        buf.fail(StreamStalledError(
            f"the client read none of this stream's output for {seconds:.0f} s while {buf.capacity} updates "
            f"waited (limit {self.stream_stall_timeout_s:g} s); the request was stopped to bound the server's "
            f"memory; read the stream as it arrives"))
        self._release(request_id, abort=True)

    def _deliver_error(self, request_id: str | None, error: BaseException) -> None:
        targets = list(self._streams.values()) if request_id is None else [self._streams.get(request_id)]
        for buf in targets:
            if buf is not None:
                buf.fail(error)

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not self._handle_commands(block=not self.engine.has_unfinished()):
                    break
                deltas: list[OutputDelta] = []
                if self.engine.has_unfinished():
                    try:
                        deltas = self._deltas(self.engine.step())
                        self._failures_in_a_row = 0
                    except StepFailedError as e:
                        self._step_failed(e)
                    self._num_steps += 1
                self._publish_snapshot()
                if deltas:
                    self._call_in_loop(self._deliver, deltas)
        except BaseException as e:  # noqa: BLE001 -- the thread must report every failure, then die
            logger.exception("engine step failed; the engine stops serving")
            self._abort_all()  # before the error is visible: whoever sees the engine dead sees its blocks free
            self.error = e
            if self.death_reason is None:
                self.death_reason = f"an engine step raised {e!r}"
            self._call_in_loop(self._deliver_error, None,
                               EngineDeadError(f"the engine failed while running this request: {e!r}"))
        finally:
            self._abort_all()
            self._sent.clear()
            self._publish_snapshot()

    def _deltas(self, outputs: list[RequestOutput | OutputDelta]) -> list[OutputDelta]:
        """The step's outputs as deltas: the executor makes them itself for the requests added here
        (Request.emit_deltas: O(new tokens) per step, not O(output)); a cumulative output (an engine
        without that) is diffed against what was sent."""
        deltas = []
        for out in outputs:
            if isinstance(out, OutputDelta):
                deltas.append(out)
                continue
            sent = self._sent.setdefault(out.request_id, SentOutput())
            deltas.append(to_delta(out, sent))
            if out.finished:
                del self._sent[out.request_id]
        return deltas

    def _step_failed(self, e: StepFailedError) -> None:
        """The engine aborted the step's requests; fail their streams, or die after too many in a row."""
        self._num_step_failures += 1
        self._num_failed_requests += len(e.request_ids)
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= self.max_step_failures:
            self.death_reason = (f"{self._failures_in_a_row} engine steps in a row failed; the last raised "
                                 f"{e.cause!r}")
            raise e.cause
        logger.error("an engine step failed; its %d request(s) are stopped, the engine goes on",
                     len(e.request_ids), exc_info=e.cause)
        for request_id in e.request_ids:
            self._sent.pop(request_id, None)
            self._call_in_loop(self._deliver_error, request_id, RequestFailedError(
                f"the engine step that ran this request failed ({e.cause!r}); the request was stopped and the "
                f"server goes on; retry it"))

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
                self._sent.pop(cmd.request_id, None)
            else:
                self._add(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: _Add) -> None:
        try:
            req = self.engine.add_request(cmd.prompt_token_ids, cmd.params, cmd.request_id, cmd.grammar)
            req.emit_deltas = True  # the executor sends what each step added (OutputDelta), see _deltas
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
            num_speculative_tokens=speculation_length(proposer), num_held_blocks=num_held_blocks(eng.blocks),
            num_requests=len(eng.requests), num_step_failures=self._num_step_failures,
            num_failed_requests=self._num_failed_requests)


class RequestStream:
    """One request's cumulative outputs, as an async iterator; the last output has finished=True.

    It reassembles the deltas the engine sends (a slow reader gets everything that arrived since its
    last read as one output). Closing it early (`aclose()`, or cancelling the task awaiting the next
    output) aborts the request. Unlike an async generator, `aclose()` works even if iteration never
    started, so a response that is cancelled before its first read still frees the request.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, buffer: _StreamBuffer, prompt_token_ids: list[int]):
        self.request_id = request_id
        self._owner = owner
        self._buffer = buffer
        self._prompt_token_ids = prompt_token_ids
        self._text = ""
        self._token_ids: list[int] = []
        self._origins: list[str] = []
        self._logprobs: list[TokenLogprob] | None = None
        self._prompt_logprobs: list[TokenLogprob | None] | None = None
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
            deltas, error = await self._buffer.take()
        except BaseException:  # the consumer was cancelled: abort
            await self.aclose()
            raise
        if error is not None:
            self.error = error
            await self.aclose()
            raise error
        for d in deltas:
            self._apply(d)
        last = deltas[-1]
        out = RequestOutput(self.request_id, None, self._prompt_token_ids, self._text, list(self._token_ids),
                            list(self._origins), last.finished, last.finish_reason, last.metrics,
                            None if self._logprobs is None else list(self._logprobs), self._prompt_logprobs)
        if last.finished:
            self._is_finished = True
            await self.aclose()
        return out

    def _apply(self, d: OutputDelta) -> None:
        if d.text_keep < len(self._text):
            self._text = self._text[:d.text_keep]
        self._text += d.text
        self._token_ids.extend(d.token_ids)
        self._origins.extend(d.token_origins)
        if d.logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self._prompt_logprobs = d.prompt_logprobs

    async def aclose(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            self._owner._release(self.request_id, abort=not self._is_finished)


def _copy_map(value: Mapping) -> dict[str, object]:
    """A shallow copy of a proposer's `weights` or `draft_stats` mapping."""
    return {str(k): v for k, v in value.items()}
