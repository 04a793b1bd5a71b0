"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine, plus /health, /metrics and vLLM's
/tokenize and /detokenize.

A request goes: size-limited body -> JSON + strict schema -> model check -> field policy (unknown
fields counted, near misses and unsupported values refused; server/schemas.py) ->
tokenize (on one tokenizer thread, so a megabyte prompt never stalls the event loop) -> context
checks -> admission (429 when the queue is full) -> stream or collect outputs. Every failure before
the response starts is an OpenAI error body with a 4xx/5xx status; a failure after a stream started
is sent as a final `data: {"error": ...}` event followed by `data: [DONE]`. A shutdown that runs out
of time ends the requests still running the same way, with a 503 (server/shutdown.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import jinja2
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from specfleet.engine.async_engine import AsyncEngine, RequestStream
from specfleet.llm import LLM
from specfleet.outputs import RequestOutput
from specfleet.server import serving
from specfleet.server.auth import ApiKeyMiddleware
from specfleet.server.errors import (APIError, BodyTooLarge, MaxBodySizeMiddleware, api_error_from,
                                     body_too_large, install_error_handlers)
from specfleet.server.metrics import ServerMetrics
from specfleet.server.chat import ChatRenderer
from specfleet.server.schemas import (DEFAULT_COMPLETION_TOKENS, ChatCompletionRequest, CompletionRequest,
                                      DetokenizeRequest, TokenizeChatRequest, TokenizeRequest,
                                      describe_validation_error)
from specfleet.server.shutdown import Drain

T = TypeVar("T")
M = TypeVar("M", CompletionRequest, ChatCompletionRequest, TokenizeRequest, TokenizeChatRequest, DetokenizeRequest)


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    max_queue: int = 256
    max_body_bytes: int = 2 << 20
    shutdown_timeout_s: float = 30.0
    api_key: str | None = None  # every route but /health then needs `Authorization: Bearer <key>`
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed by CORS ("*": any); none: no CORS headers
    chat_template: str | None = None  # a Jinja chat template replacing the model's own (--chat-template)


class ClientGone(Exception):
    """The client disconnected before its non-streamed response was ready."""


def create_app(llm: LLM, config: ServerConfig) -> FastAPI:
    engine = AsyncEngine(llm.engine, config.max_queue)
    metrics = ServerMetrics(engine)
    tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="specfleet-tokenizer")
    drain = Drain(config.shutdown_timeout_s)
    max_len, vocab = llm.engine.max_model_len, llm.model.config.vocab_size
    specials = serving.special_tokens(llm.tokenizer)
    chat = ChatRenderer(llm, config.chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:  # uvicorn has already let in-flight responses finish (or cancelled them) by now
            await engine.shutdown(config.shutdown_timeout_s)
            tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specfleet", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.max_body_bytes = config.max_body_bytes
    app.state.engine = engine
    app.state.drain = drain  # `specfleet serve` starts it when uvicorn begins its shutdown
    # the last added runs first: CORS answers preflights (which carry no credentials) and labels every
    # response, even a 401; then the key is checked before the body is read; then the body's size
    app.add_middleware(MaxBodySizeMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    install_error_handlers(app)

    async def tokenize(fn: Callable[[], list[int]]) -> list[int]:
        try:
            return await drain.race(asyncio.get_running_loop().run_in_executor(tokenizer_pool, fn))
        except jinja2.TemplateError as e:  # e.g. a template that insists roles alternate
            raise APIError(400, f"the model's chat template rejected these messages: {e}", param="messages")

    async def read_json(request: Request) -> bytes:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise APIError(415, f"the body must be JSON sent with Content-Type: application/json, "
                                f"got {ctype or 'no content type'!r}", code="unsupported_media_type")
        return await request.body()

    async def parse(request: Request, schema: type[M], endpoint: str, body: bytes | None = None) -> M:
        if body is None:
            body = await read_json(request)
        try:
            req = schema.model_validate_json(body)
        except ValidationError as e:
            message, param = describe_validation_error(e)
            raise APIError(400, message, param=param)
        if req.model is not None and req.model != config.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{config.model_name!r}", param="model", code="model_not_found")
        for field in req.check_fields():
            metrics.observe_unknown_field(endpoint, field)
        req.check_supported()
        return req

    async def serve(endpoint: str, request: Request, fn: Callable[[], Awaitable[Response]]) -> Response:
        """Run a handler; count it; turn any error into the OpenAI error response."""
        try:
            drain.check_accepting()
            return await fn()
        except ClientGone:
            metrics.observe_rejected(endpoint, 499)
            return Response(status_code=499)  # nobody reads it; keeps the access log honest
        except BodyTooLarge:
            err = body_too_large(config.max_body_bytes)
        except Exception as e:  # noqa: BLE001 -- mapped to a status; unexpected ones are logged
            err = api_error_from(e)
        metrics.observe_rejected(endpoint, err.status)
        return err.response()

    def start(prompt_ids: list[int], req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              kind: str, default_max_tokens: int | None = None) -> tuple[serving.Prepared, RequestStream]:
        serving.check_prompt(prompt_ids, vocab, max_len)
        params = serving.sampling_params(req, max_tokens, len(prompt_ids), max_len, specials, default_max_tokens)
        prepared = serving.Prepared(serving.new_request_id(kind), prompt_ids, params, serving.now())
        return prepared, engine.generate(prompt_ids, params, prepared.request_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def handle() -> Response:
            req = await parse(request, CompletionRequest, "completions")
            prompt = req.single_prompt()
            ids = await tokenize(lambda: llm.encode(prompt))
            p, stream = start(ids, req, req.max_tokens, "cmpl", DEFAULT_COMPLETION_TOKENS)
            if req.stream:
                end = _StreamEnd()
                return sse(completion_events(p, req, stream, end), closing(stream, "completions", end))
            out = await collect(request, stream, drain)
            metrics.observe_finished("completions", out)
            return JSONResponse(serving.completion_body(p, config.model_name, out))
        return await serve("completions", request, handle)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def handle() -> Response:
            req = await parse(request, ChatCompletionRequest, "chat")
            messages, kwargs = req.template_messages(), req.chat_template_kwargs
            ids = await tokenize(lambda: chat.render(messages, kwargs))
            p, stream = start(ids, req, req.requested_max_tokens(), "chatcmpl")
            if req.stream:
                end = _StreamEnd()
                return sse(chat_events(p, req, stream, end), closing(stream, "chat", end))
            out = await collect(request, stream, drain)
            metrics.observe_finished("chat", out)
            return JSONResponse(serving.chat_body(p, config.model_name, out))
        return await serve("chat", request, handle)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        """vLLM's /tokenize: the token ids of a prompt, or of the prompt a chat request would get."""
        async def handle() -> Response:
            body = await read_json(request)
            if _has_key(body, "messages"):
                chat_req = await parse(request, TokenizeChatRequest, "tokenize", body)
                messages, kwargs = chat_req.template_messages(), chat_req.chat_template_kwargs
                ids = await tokenize(lambda: chat.render(messages, kwargs, chat_req.add_generation_prompt))
                want_strs = chat_req.return_token_strs
            else:
                req = await parse(request, TokenizeRequest, "tokenize", body)
                ids = await tokenize(lambda: encode(req.prompt, req.add_special_tokens))
                want_strs = req.return_token_strs
            out: dict[str, Any] = {"count": len(ids), "max_model_len": max_len, "tokens": ids}
            if want_strs:
                out["token_strs"] = llm.tokenizer.convert_ids_to_tokens(ids)
            return JSONResponse(out)
        return await serve("tokenize", request, handle)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        """vLLM's /detokenize: the text of token ids, special tokens included (what the model sees)."""
        async def handle() -> Response:
            req = await parse(request, DetokenizeRequest, "detokenize")
            if llm.tokenizer is None:
                raise APIError(400, "this model has no tokenizer, so token ids cannot become text", param="tokens")
            bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
            tokens = req.tokens
            text = await drain.race(asyncio.get_running_loop().run_in_executor(
                tokenizer_pool, lambda: llm.tokenizer.decode(tokens)))
            return JSONResponse({"prompt": text})
        return await serve("detokenize", request, handle)

    def encode(prompt: str, add_special_tokens: bool) -> list[int]:
        if add_special_tokens or llm.tokenizer is None:
            return llm.encode(prompt)  # the prompt /v1/completions would get (or its "no tokenizer" error)
        return llm.tokenizer.encode(prompt, add_special_tokens=False)

    def closing(stream: RequestStream, endpoint: str, end: _StreamEnd) -> Callable[[], Awaitable[None]]:
        async def close() -> None:  # when a streamed response ends, however it ends
            if not end.counted:  # neither finished nor failed: the client went away mid-stream
                metrics.observe_rejected(endpoint, 499)
            await stream.aclose()
        return close

    async def completion_events(p: serving.Prepared, req: CompletionRequest, stream: RequestStream,
                                end: _StreamEnd) -> AsyncIterator[str]:
        def chunk(text: str, out: RequestOutput | None) -> dict[str, Any]:
            return serving.completion_chunk(p, config.model_name, text, out)
        async for event in stream_events("completions", p, req, stream, end, chunk, "text_completion"):
            yield event

    async def chat_events(p: serving.Prepared, req: ChatCompletionRequest, stream: RequestStream,
                          end: _StreamEnd) -> AsyncIterator[str]:
        def chunk(text: str, out: RequestOutput | None) -> dict[str, Any]:
            return serving.chat_chunk(p, config.model_name, {"content": text}, out)
        # OpenAI opens every chat stream with the role; it also gets the headers to the client at once
        yield data(with_usage_field(req, serving.chat_chunk(p, config.model_name,
                                                            {"role": "assistant", "content": ""}, None)))
        async for event in stream_events("chat", p, req, stream, end, chunk, "chat.completion.chunk"):
            yield event

    async def stream_events(endpoint: str, p: serving.Prepared, req: CompletionRequest | ChatCompletionRequest,
                            stream: RequestStream, end: _StreamEnd,
                            chunk: Callable[[str, RequestOutput | None], dict[str, Any]],
                            obj: str) -> AsyncIterator[str]:
        deltas = serving.DeltaText(p.params.stop)
        try:
            while (out := await drain.race(next_output(stream))) is not None:
                text = deltas.delta(out)
                if text or out.finished:
                    yield data(with_usage_field(req, chunk(text, out)))
                if out.finished:
                    metrics.observe_finished(endpoint, out)
                    end.counted = True
                    if wants_usage(req):
                        yield data(serving.usage_chunk(p, config.model_name, out, obj))
        except Exception as e:  # noqa: BLE001 -- the status line is sent; report in-band, as OpenAI does
            err = api_error_from(e)
            metrics.observe_rejected(endpoint, err.status)
            end.counted = True
            yield data(err.body())
        yield "data: [DONE]\n\n"

    model_card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "specfleet",
                  "max_model_len": max_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")  # `:path`: a model id may hold slashes (a folder path)
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != config.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                                f"{config.model_name!r}", param="model", code="model_not_found")
        return model_card

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: the same status, no body
    async def health() -> Response:
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        reason = f"engine failed: {engine.error!r}" if engine.error else "shutting down"
        return APIError(503, reason, "service_unavailable").response()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def wants_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def with_usage_field(req: CompletionRequest | ChatCompletionRequest, body: dict[str, Any]) -> dict[str, Any]:
    """With include_usage, OpenAI gives every chunk a `usage` field, null on all but the usage chunk."""
    if wants_usage(req):
        body["usage"] = None
    return body


def _has_key(body: bytes, key: str) -> bool:
    """Whether the JSON object in `body` has `key`; anything unparsable is left to the schema's error."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested arrays
        return False
    return isinstance(obj, dict) and key in obj


def data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


@dataclass
class _StreamEnd:
    """Whether a streamed response's outcome (finished or failed) is already in the metrics."""

    counted: bool = False


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its event generator and its engine stream when the response ends, however it ends.

    Starlette abandons the body iterator when the client disconnects, possibly before iterating it
    at all; left to the garbage collector, the engine request (and its KV blocks) would live on.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
            await self._on_close()


def sse(events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> StreamingResponse:
    return _ClosingStreamingResponse(events, on_close)


async def collect(request: Request, stream: RequestStream, drain: Drain) -> RequestOutput:
    """The final output of a non-streamed request; aborts it if the client disconnects first, or
    raises the 503 of an aborted request if the shutdown drain ends it first."""
    try:
        return await until_disconnect(request, drain.race(last_output(stream)))
    finally:
        await stream.aclose()  # a no-op when it finished; frees it even if the reader never started


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
