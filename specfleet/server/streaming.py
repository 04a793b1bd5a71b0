"""Getting a response's choices to the client: server-sent events for a stream, the final outputs for a
whole response, and the clean-up both need when the client goes away.

A failure after a stream started is sent as a final `data: {"error": ...}` event followed by
`data: [DONE]`. A shutdown that runs out of time ends the requests still running the same way, with a
503 (server/shutdown.py). Whoever stops reading is stopped: a stream's request when its buffer stays
full (async_engine.py) or its socket takes nothing (server/stall.py), a whole response's requests when
the client disconnects.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from specfleet.engine.async_engine import RequestStream
from specfleet.outputs import RequestOutput
from specfleet.server import responses
from specfleet.server.context import Choice, ClientGone, ServerContext
from specfleet.server.errors import api_error_from
from specfleet.server.schemas import ChatCompletionRequest, CompletionRequest
from specfleet.server.shutdown import Drain
from specfleet.server.stall import StallGuard

T = TypeVar("T")

# (fields of the chunk's choice, whether it is the choice's final chunk, finish_reason override)
Chunk = tuple[dict[str, Any], bool, "str | None"]


class ChoiceStream(Protocol):
    """One choice's streamed shaping (CompletionStream, ChatStream): its chunks for each new output."""

    skip_tokens: int

    def chunks(self, out: RequestOutput) -> list[Chunk]: ...


def wants_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def with_usage_field(req: CompletionRequest | ChatCompletionRequest, body: dict[str, Any]) -> dict[str, Any]:
    """With include_usage, OpenAI gives every chunk a `usage` field, null on all but the usage chunk."""
    if wants_usage(req):
        body["usage"] = None
    return body


def data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


@dataclass
class StreamEnd:
    """Whether a streamed response's outcome (finished or failed) is already in the metrics."""

    counted: bool = False


def stream_response(ctx: ServerContext, endpoint: str, response_id: str, created: int, obj: str,
                    req: CompletionRequest | ChatCompletionRequest, choices: list[Choice],
                    states: list[ChoiceStream]) -> StreamingResponse:
    """The SSE response of a streamed request: its choices' chunks, closed however it ends."""
    end = StreamEnd()
    events = stream_events(ctx, endpoint, response_id, created, obj, req, choices, states, end)

    async def close() -> None:  # when a streamed response ends, however it ends
        if not end.counted:  # neither finished nor failed: the client went away mid-stream
            ctx.metrics.observe_rejected(endpoint, 499)
        for c in choices:
            await c.stream.aclose()
    return _ClosingStreamingResponse(events, close, ctx.stall_guard)


async def stream_events(ctx: ServerContext, endpoint: str, response_id: str, created: int, obj: str,
                        req: CompletionRequest | ChatCompletionRequest, choices: list[Choice],
                        states: list[ChoiceStream], end: StreamEnd) -> AsyncIterator[str]:
    """The chunks of every choice, as their outputs arrive; then the usage chunk if asked; then [DONE]."""
    model = ctx.config.model_name

    def chunk(index: int, fields: dict[str, Any], out: RequestOutput | None, finish: str | None = None) -> str:
        return data(with_usage_field(req, responses.chunk(response_id, created, model, obj, index, fields, out,
                                                          finish)))
    if obj == "chat.completion.chunk":
        # OpenAI opens every chat stream with the role; it also gets the headers to the client at once
        for c in choices:
            yield chunk(c.index, {"delta": {"role": "assistant", "content": ""}, "logprobs": None}, None)
    finals: dict[int, RequestOutput] = {}
    try:
        async for k, out in merged(choices, ctx.drain):
            for fields, final, finish in states[k].chunks(out):
                yield chunk(choices[k].index, fields, out if final else None, finish)
            if out.finished:
                ctx.metrics.observe_finished(endpoint, out)
                finals[k] = out
        end.counted = True
        if wants_usage(req):
            outs = [finals[k] for k in sorted(finals)]
            skip = states[0].skip_tokens if states else 0
            yield data(responses.usage_chunk(response_id, created, model, obj,
                                             responses.usage(outs, req.n, skip), outs))
    except Exception as e:  # noqa: BLE001 -- the status line is sent; report in-band, as OpenAI does
        err = api_error_from(e)
        ctx.metrics.observe_rejected(endpoint, err.status)
        end.counted = True
        yield data(err.body())
    yield "data: [DONE]\n\n"


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its event generator and its engine stream when the response ends, however it ends.

    Starlette abandons the body iterator when the client disconnects, possibly before iterating it
    at all; left to the garbage collector, the engine request (and its KV blocks) would live on.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], guard: StallGuard):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close
        self._guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = self._guard.watch(scope)  # a client that stops reading gets its connection closed
        try:
            await super().__call__(scope, receive, send)
        finally:
            if watch is not None:
                watch.cancel()
            await self._events.aclose()  # type: ignore[attr-defined]
            await self._on_close()


async def collect(ctx: ServerContext, endpoint: str, request: Request, choices: list[Choice]) -> list[RequestOutput]:
    """The final outputs of a non-streamed request's choices, counted as finished; aborts them all if the
    client disconnects first, or raises the 503 of an aborted request if the shutdown drain ends them first."""
    try:
        outs = await until_disconnect(request, ctx.drain.race(
            asyncio.gather(*(last_output(c.stream) for c in choices))))
    finally:
        for c in choices:  # a no-op for the finished; frees the others even if their reader never started
            await c.stream.aclose()
    for out in outs:
        ctx.metrics.observe_finished(endpoint, out)
    return outs



async def reply(ctx: ServerContext, endpoint: str, request: Request, req: Any, response_id: str, choices: list[Choice],
                shape: Any, obj: str, chunk_obj: str) -> Response:
    """A generating endpoint's response: its choices streamed as `chunk_obj` events, or once every choice has
    finished, the whole `obj` body. `shape` is the endpoint's: `stream_state(choice)`, `final(choice, output)`
    and the prompt tokens its usage skips."""
    created = responses.now()
    if req.stream:
        return stream_response(ctx, endpoint, response_id, created, chunk_obj, req, choices,
                               [shape.stream_state(c) for c in choices])
    outs = await collect(ctx, endpoint, request, choices)
    return JSONResponse(responses.response_body(obj, response_id, created, ctx.config.model_name,
                                                [shape.final(c, out) for c, out in zip(choices, outs)],
                                                responses.usage(outs, req.n, shape.skip_tokens)))


async def merged(choices: list[Choice], drain: Drain) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice number, output) from every choice's stream as they arrive, until all have finished."""
    waiting: dict[asyncio.Future, int] = {}

    def arm(k: int) -> None:
        waiting[asyncio.ensure_future(drain.race(next_output(choices[k].stream)))] = k

    for k in range(len(choices)):
        arm(k)
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: waiting[t]):
                k = waiting.pop(task)
                out = task.result()
                if out is None:
                    continue
                yield k, out
                if not out.finished:
                    arm(k)
    finally:
        for task in waiting:  # cancelling a wait on a stream aborts its request (RequestStream)
            task.cancel()


async def last_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished, "an engine stream ends with a finished output"
    return last


async def next_output(stream: RequestStream) -> RequestOutput | None:
    """The stream's next output, or None once it has ended."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting its request) if the client disconnects first.

    Starlette does this for streamed responses; a non-streamed handler has to watch on its own.
    """
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself is cancelled (shutdown timeout): pass it on
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()
