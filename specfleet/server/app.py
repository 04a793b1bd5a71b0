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
from specfleet.errors import InvalidRequestError
from specfleet.llm import LLM
from specfleet.outputs import RequestOutput
from specfleet.server import serving
from specfleet.server.admission import (LARGE_BODY_BYTES, Admission, HeapTrim, PromptLengthBound,
                                        background_priority, idle_priority)
from specfleet.server.auth import ApiKeyMiddleware, HostAllowlistMiddleware
from specfleet.server.errors import (APIError, BodyTooLarge, MaxBodySizeMiddleware, api_error_from,
                                     body_too_large, install_error_handlers)
from specfleet.server.metrics import ServerMetrics
from specfleet.server.chat import ChatRenderer
from specfleet.server.choices import ChatShape, Choice, CompletionShape
from specfleet.server.schemas import (DEFAULT_COMPLETION_TOKENS, ChatCompletionRequest, CompletionRequest,
                                      DetokenizeRequest, TokenizeChatRequest, TokenizeRequest,
                                      describe_validation_error)
from specfleet.server.shutdown import Drain
from specfleet.server.stall import TRANSPORT_KEY, StallGuard, transport_of
from specfleet.server.worker import add_worker_routes

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
    # a stream's reader that leaves this many updates unread for this long is stopped (async_engine.py)
    stream_buffer: int = 64
    stream_stall_timeout_s: float = 30.0
    # a JSON schema keyword the grammar engine cannot enforce: "refuse" (400) or "relax" (generate under the
    # rest of the schema, said in the response) where the request leaves `strict` unsaid (runtime/sample/json_schema.py)
    unenforceable_schema: str = "refuse"
    # tokenizer / template / grammar work runs on these threads, off the event loop and the engine thread
    tokenizer_workers: int = 2
    # requests being prepared (tokenized, grammars compiled) at once; one more gets 429 before any work
    # (None: max_queue; requests being prepared also count against max_queue, server/admission.py)
    max_preparing: int | None = None
    # Host names served without an API key besides localhost, IPs and this machine's name ("*": any)
    allowed_hosts: tuple[str, ...] = ()


class ServerApp(FastAPI):
    """FastAPI, with each HTTP request's connection transport in its scope (TRANSPORT_KEY), taken from
    the server's own `send` before any middleware wraps it: the stall guard watches the socket
    (server/stall.py)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            transport = transport_of(send)
            if transport is not None:
                scope[TRANSPORT_KEY] = transport
        await super().__call__(scope, receive, send)


class ClientGone(Exception):
    """The client disconnected before its non-streamed response was ready."""


def create_app(llm: LLM, config: ServerConfig) -> FastAPI:
    engine = AsyncEngine(llm.engine, config.max_queue, config.stream_buffer, config.stream_stall_timeout_s)
    stall_guard = StallGuard(config.stream_stall_timeout_s)
    metrics = ServerMetrics(engine, stall_guard)
    if config.tokenizer_workers < 1:
        raise InvalidRequestError(f"tokenizer_workers must be >= 1, got {config.tokenizer_workers}")
    tokenizer_pool = ThreadPoolExecutor(config.tokenizer_workers, thread_name_prefix="specfleet-tokenizer",
                                        initializer=background_priority)
    # grammars of large requests (a megabyte regex: seconds) compile here, on time the engine leaves idle
    grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="specfleet-grammar", initializer=idle_priority)
    admission = Admission(engine, config.max_preparing or config.max_queue)
    trim = HeapTrim()
    length_bound = PromptLengthBound(llm.tokenizer, llm.engine.max_model_len)
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
            grammar_pool.shutdown(wait=False, cancel_futures=True)

    app = ServerApp(title="specfleet", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.max_body_bytes = config.max_body_bytes
    app.state.engine = engine
    app.state.admission = admission
    app.state.drain = drain  # `specfleet serve` starts it when uvicorn begins its shutdown
    # the last added runs first: CORS answers preflights (which carry no credentials) and labels every
    # response, even a 401; then the key is checked before the body is read; then the body's size
    app.add_middleware(MaxBodySizeMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    else:
        app.add_middleware(HostAllowlistMiddleware, allowed_hosts=config.allowed_hosts)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    install_error_handlers(app)

    async def tokenize(fn: Callable[[], T], pool: ThreadPoolExecutor | None = None) -> T:
        try:
            return await drain.race(asyncio.get_running_loop().run_in_executor(pool or tokenizer_pool, fn))
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
            if len(body) > LARGE_BODY_BYTES:  # tens of ms of parsing (a 900k-id list): off the event loop,
                req = await asyncio.get_running_loop().run_in_executor(  # which writes every stream's tokens
                    None, schema.model_validate_json, body)
                request.state.large = True  # the heap is trimmed after it (serve)
            else:
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
        finally:
            if getattr(request.state, "large", False):
                trim.after_large_request()
        metrics.observe_rejected(endpoint, err.status)
        return err.response()

    async def start(prompts: list[list[int]], req: CompletionRequest | ChatCompletionRequest,
                    max_tokens: int | None, kind: str, default_max_tokens: int | None = None,
                    prompt_texts: list[str | None] | None = None, large: bool = False) -> tuple[str, list[Choice]]:
        """Admit every choice of a request: `n` samples of each prompt, each its own engine request
        (choice i * n + j is sample j of prompt i). All are checked before any starts; if one cannot
        start, the ones already started are aborted."""
        total = len(prompts) * req.n
        if total > config.max_queue:
            raise APIError(400, f"this request asks for {total} choices ({len(prompts)} prompt(s) x n={req.n}); "
                                f"at most {config.max_queue} fit the queue", param="n")
        serving.check_stop_token_ids(req, vocab)
        for ids in prompts:
            serving.check_prompt(ids, vocab, max_len)
        structured, matchers = None, None
        if serving.is_constrained(req):  # checked here, so an invalid grammar is a 400 before the response
            # starts. Compiling it (seconds for a megabyte regex; the first one also builds the grammar
            # engine's view of the tokenizer) and each choice's matcher: on a worker, never on the event
            # loop or the engine thread, which every other request waits on
            def compile_all() -> tuple[Any, list[Any]]:
                compiler = llm.engine.grammar_compiler()
                spec = serving.structured_outputs(req, compiler, config.unenforceable_schema == "relax")
                return spec, [compiler.matcher(spec) for _ in range(total)]
            structured, matchers = await tokenize(compile_all, grammar_pool if large else None)
        plans = []
        for i, ids in enumerate(prompts):
            for j in range(req.n):
                plans.append((i, ids, serving.sampling_params(req, max_tokens, len(ids), max_len, specials,
                                                              default_max_tokens, sample=j, structured=structured)))
        response_id = serving.new_request_id(kind)
        choices: list[Choice] = []
        try:
            for k, (i, ids, params) in enumerate(plans):
                rid = response_id if total == 1 else f"{response_id}-{k}"
                choices.append(Choice(k, ids, params, engine.generate(ids, params, rid,
                                                                      matchers[k] if matchers else None),
                                      prompt_texts[i] if prompt_texts else None))
        except BaseException:
            for c in choices:
                await c.stream.aclose()
            raise
        return response_id, choices

    def prompt_text(prompt: str | list[int], ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return llm.tokenizer.decode(ids) if llm.tokenizer is not None else ""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def handle() -> Response:
            req = await parse(request, CompletionRequest, "completions")
            prompts = req.prompts()
            with admission.preparing(len(prompts) * req.n):
                for p in prompts:  # a prompt too long for the context is refused before it is tokenized
                    if isinstance(p, str):
                        length_bound.check(p)
                ids = [await tokenize(lambda p=p: length_bound.encode(p, llm.encode)) for p in prompts]
                texts = [await tokenize(lambda p=p, i=i: prompt_text(p, i)) for p, i in zip(prompts, ids)] \
                    if req.echo else None  # (decoding a token prompt is tokenizer work too: off the event loop)
                response_id, choices = await start(ids, req, req.max_tokens, "cmpl", DEFAULT_COMPLETION_TOKENS,
                                                   texts, large=getattr(request.state, "large", False))
            created = serving.now()
            shape = CompletionShape(req, token_text)
            if req.stream:
                end = _StreamEnd()
                events = stream_events("completions", response_id, created, "text_completion", req, choices,
                                       [shape.stream_state(c) for c in choices], end)
                return sse(events, closing(choices, "completions", end), stall_guard)
            outs = await collect(request, choices, drain)
            for out in outs:
                metrics.observe_finished("completions", out)
            return JSONResponse(serving.completion_body(
                response_id, created, config.model_name, [shape.final(c, out) for c, out in zip(choices, outs)],
                serving.usage(outs, req.n, shape.skip_tokens)))
        return await serve("completions", request, handle)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def handle() -> Response:
            req = await parse(request, ChatCompletionRequest, "chat")
            messages, kwargs, tool_defs = req.template_messages(), req.chat_template_kwargs, req.active_tools()
            with admission.preparing(req.n):
                length_bound.check("\n".join(m["content"] for m in messages))  # the prompt holds all of these
                if req.tools and llm.tokenizer is not None:  # every tool's `parameters`, whatever tool_choice says
                    await tokenize(lambda: serving.check_tool_parameters(req.tools, llm.engine.grammar_compiler()))
                ids = await tokenize(lambda: chat.render(messages, kwargs, tool_defs=tool_defs))
                parse_tools = tool_defs is not None and chat.tool_parser() is not None
                response_id, choices = await start([ids], req, req.requested_max_tokens(), "chatcmpl",
                                                   large=getattr(request.state, "large", False))
            created = serving.now()
            shape = ChatShape(req, token_text, parse_tools)
            if req.stream:
                end = _StreamEnd()
                events = stream_events("chat", response_id, created, "chat.completion.chunk", req, choices,
                                       [shape.stream_state(c) for c in choices], end)
                return sse(events, closing(choices, "chat", end), stall_guard)
            outs = await collect(request, choices, drain)
            for out in outs:
                metrics.observe_finished("chat", out)
            return JSONResponse(serving.chat_body(
                response_id, created, config.model_name, [shape.final(c, out) for c, out in zip(choices, outs)],
                serving.usage(outs, req.n)))
        return await serve("chat", request, handle)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        """vLLM's /tokenize: the token ids of a prompt, or of the prompt a chat request would get."""
        async def handle() -> Response:
            body = await read_json(request)
            if _has_key(body, "messages"):
                chat_req = await parse(request, TokenizeChatRequest, "tokenize", body)
                messages, kwargs = chat_req.template_messages(), chat_req.chat_template_kwargs
                tool_defs = chat_req.active_tools()
                ids = await tokenize(lambda: chat.render(messages, kwargs, chat_req.add_generation_prompt, tool_defs))
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

    def closing(choices: list[Choice], endpoint: str, end: _StreamEnd) -> Callable[[], Awaitable[None]]:
        async def close() -> None:  # when a streamed response ends, however it ends
            if not end.counted:  # neither finished nor failed: the client went away mid-stream
                metrics.observe_rejected(endpoint, 499)
            for c in choices:
                await c.stream.aclose()
        return close

    async def stream_events(endpoint: str, response_id: str, created: int, obj: str,
                            req: CompletionRequest | ChatCompletionRequest, choices: list[Choice],
                            states: list[Any], end: _StreamEnd) -> AsyncIterator[str]:
        """The chunks of every choice, as their outputs arrive; then the usage chunk if asked; then [DONE]."""
        def chunk(index: int, fields: dict[str, Any], out: RequestOutput | None, finish: str | None = None) -> str:
            return data(with_usage_field(req, serving.chunk(response_id, created, config.model_name, obj, index,
                                                            fields, out, finish)))
        if obj == "chat.completion.chunk":
            # OpenAI opens every chat stream with the role; it also gets the headers to the client at once
            for c in choices:
                yield chunk(c.index, {"delta": {"role": "assistant", "content": ""}, "logprobs": None}, None)
        finals: dict[int, RequestOutput] = {}
        try:
            async for k, out in merged(choices, drain):
                for fields, final, finish in states[k].chunks(out):
                    yield chunk(choices[k].index, fields, out if final else None, finish)
                if out.finished:
                    metrics.observe_finished(endpoint, out)
                    finals[k] = out
            end.counted = True
            if wants_usage(req):
                outs = [finals[k] for k in sorted(finals)]
                skip = states[0].skip_tokens if states else 0
                yield data(serving.usage_chunk(response_id, created, config.model_name, obj,
                                               serving.usage(outs, req.n, skip), outs))
        except Exception as e:  # noqa: BLE001 -- the status line is sent; report in-band, as OpenAI does
            err = api_error_from(e)
            metrics.observe_rejected(endpoint, err.status)
            end.counted = True
            yield data(err.body())
        yield "data: [DONE]\n\n"

    token_text = serving.TokenText(llm.tokenizer)

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
        # the cause (an exception's text) is in the server log, not for whoever can reach /health
        reason = "engine failed (the server log has the cause)" if engine.error else "shutting down"
        return APIError(503, reason, "service_unavailable").response()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_worker_routes(app, llm, engine, drain, config.model_name)  # /server_info, /v1/loads, /drain (routers)
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


def sse(events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], guard: StallGuard) -> StreamingResponse:
    return _ClosingStreamingResponse(events, on_close, guard)


async def collect(request: Request, choices: list[Choice], drain: Drain) -> list[RequestOutput]:
    """The final outputs of a non-streamed request's choices; aborts them all if the client disconnects
    first, or raises the 503 of an aborted request if the shutdown drain ends them first."""
    try:
        return await until_disconnect(request, drain.race(
            asyncio.gather(*(last_output(c.stream) for c in choices))))
    finally:
        for c in choices:  # a no-op for the finished; frees the others even if their reader never started
            await c.stream.aclose()


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
