"""What every endpoint shares: the engine and its helpers, and the steps every request goes through.

A request goes: size-limited body -> JSON + strict schema -> model check -> field policy (unknown
fields counted, near misses and unsupported values refused; server/schemas.py) -> tokenize (on the
tokenizer workers, so a megabyte prompt never stalls the event loop) -> context checks -> admission
(429 when the queue is full) -> the endpoint's response. `run` maps any failure before the response
starts to an OpenAI error body with its status.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import jinja2
from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from specfleet.engine.async_engine import AsyncEngine, RequestStream
from specfleet.errors import InvalidRequestError
from specfleet.llm import LLM
from specfleet.sampling_params import SamplingParams
from specfleet.server import serving
from specfleet.server.admission import (LARGE_BODY_BYTES, Admission, HeapTrim, PromptLengthBound,
                                        background_priority, idle_priority)
from specfleet.server.chat import ChatRenderer
from specfleet.server.config import ServerConfig
from specfleet.server.errors import APIError, BodyTooLarge, api_error_from, body_too_large
from specfleet.server.metrics import ServerMetrics
from specfleet.server.responses import TokenText
from specfleet.server.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                      TokenizeRequest, describe_validation_error)
from specfleet.server.shutdown import Drain
from specfleet.server.stall import StallGuard

T = TypeVar("T")
M = TypeVar("M", CompletionRequest, ChatCompletionRequest, TokenizeRequest, TokenizeChatRequest, DetokenizeRequest)


class ClientGone(Exception):
    """The client disconnected before its non-streamed response was ready."""


@dataclass
class Choice:
    """One choice of a response: its own engine request."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    prompt_text: str | None = None  # the prompt as text, for a completion's echo


class ServerContext:
    def __init__(self, llm: LLM, config: ServerConfig):
        if config.tokenizer_workers < 1:
            raise InvalidRequestError(f"tokenizer_workers must be >= 1, got {config.tokenizer_workers}")
        self.llm, self.config = llm, config
        self.engine = AsyncEngine(llm.engine, config.max_queue, config.stream_buffer, config.stream_stall_timeout_s)
        self.stall_guard = StallGuard(config.stream_stall_timeout_s)
        self.metrics = ServerMetrics(self.engine, self.stall_guard)
        self.tokenizer_pool = ThreadPoolExecutor(config.tokenizer_workers, thread_name_prefix="specfleet-tokenizer",
                                                 initializer=background_priority)
        # grammars of large requests (a megabyte regex: seconds) compile here, on time the engine leaves idle
        self.grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="specfleet-grammar", initializer=idle_priority)
        # large bodies are parsed here, below the engine's priority (eight 2 MB prompts at once parsed at the
        # engine's priority were the longest stalls of other streams), not on asyncio's default pool
        self.parse_pool = ThreadPoolExecutor(2, thread_name_prefix="specfleet-parse", initializer=background_priority)
        self.admission = Admission(self.engine, config.max_preparing or config.max_queue)
        self.trim = HeapTrim()
        self.length_bound = PromptLengthBound(llm.tokenizer, llm.engine.max_model_len)
        self.drain = Drain(config.shutdown_timeout_s)
        self.max_len, self.vocab = llm.engine.max_model_len, llm.model.config.vocab_size
        self.specials = serving.special_tokens(llm.tokenizer)
        self.chat = ChatRenderer(llm, config.chat_template)
        self.token_text = TokenText(llm.tokenizer)

    async def start_engine(self) -> None:
        self.engine.start()

    async def stop_engine(self) -> None:
        await self.engine.shutdown(self.config.shutdown_timeout_s)
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.parse_pool.shutdown(wait=False, cancel_futures=True)

    # -- the steps of a request ---------------------------------------------------------------------
    async def tokenize(self, fn: Callable[[], T], pool: ThreadPoolExecutor | None = None) -> T:
        """Run tokenizer / template / grammar work on a worker, never the event loop."""
        try:
            return await self.drain.race(asyncio.get_running_loop().run_in_executor(pool or self.tokenizer_pool, fn))
        except jinja2.TemplateError as e:  # e.g. a template that insists roles alternate
            raise APIError(400, f"the model's chat template rejected these messages: {e}", param="messages")

    async def read_json(self, request: Request) -> bytes:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise APIError(415, f"the body must be JSON sent with Content-Type: application/json, "
                                f"got {ctype or 'no content type'!r}", code="unsupported_media_type")
        return await request.body()

    async def parse(self, request: Request, schema: type[M], endpoint: str, body: bytes | None = None) -> M:
        if body is None:
            body = await self.read_json(request)
        try:
            if len(body) > LARGE_BODY_BYTES:  # tens of ms of parsing (a 900k-id list): off the event loop,
                req = await asyncio.get_running_loop().run_in_executor(  # which writes every stream's tokens
                    self.parse_pool, schema.model_validate_json, body)
                request.state.large = True  # the heap is trimmed after it (run)
            else:
                req = schema.model_validate_json(body)
        except ValidationError as e:
            message, param = describe_validation_error(e)
            raise APIError(400, message, param=param)
        self.check_model(req.model)
        for field in req.check_fields():
            self.metrics.observe_unknown_field(endpoint, field)
        req.check_supported()
        return req

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", param="model", code="model_not_found")

    async def run(self, endpoint: str, request: Request, fn: Callable[[], Awaitable[Response]]) -> Response:
        """Run a handler; count it; turn any error into the OpenAI error response."""
        try:
            self.drain.check_accepting()
            return await fn()
        except ClientGone:
            self.metrics.observe_rejected(endpoint, 499)
            return Response(status_code=499)  # nobody reads it; keeps the access log honest
        except BodyTooLarge:
            err = body_too_large(self.config.max_body_bytes)
        except Exception as e:  # noqa: BLE001 -- mapped to a status; unexpected ones are logged
            err = api_error_from(e)
        finally:
            if getattr(request.state, "large", False):
                self.trim.after_large_request()
        self.metrics.observe_rejected(endpoint, err.status)
        return err.response()

    async def admit(self, prompts: list[list[int]], req: CompletionRequest | ChatCompletionRequest,
                    max_tokens: int | None, kind: str, default_max_tokens: int | None = None,
                    prompt_texts: list[str | None] | None = None, large: bool = False) -> tuple[str, list[Choice]]:
        """Admit every choice of a request: `n` samples of each prompt, each its own engine request
        (choice i * n + j is sample j of prompt i). All are checked before any starts; if one cannot
        start, the ones already started are aborted. `large`: the request's body was large, so its
        grammar (if any) compiles on the idle-priority worker."""
        config, llm = self.config, self.llm
        total = len(prompts) * req.n
        if total > config.max_queue:
            raise APIError(400, f"this request asks for {total} choices ({len(prompts)} prompt(s) x n={req.n}); "
                                f"at most {config.max_queue} fit the queue", param="n")
        serving.check_stop_token_ids(req, self.vocab)
        for ids in prompts:
            serving.check_prompt(ids, self.vocab, self.max_len)
        structured, matchers = None, None
        if serving.is_constrained(req):  # checked here, so an invalid grammar is a 400 before the response
            # starts. Compiling it (seconds for a megabyte regex; the first one also builds the grammar
            # engine's view of the tokenizer) and each choice's matcher: on a worker, never on the event
            # loop or the engine thread, which every other request waits on
            def compile_all() -> tuple[Any, list[Any]]:
                compiler = llm.engine.grammar_compiler()
                spec = serving.structured_outputs(req, compiler, config.unenforceable_schema == "relax")
                return spec, [compiler.matcher(spec) for _ in range(total)]
            structured, matchers = await self.tokenize(compile_all, self.grammar_pool if large else None)
        plans = []
        for i, ids in enumerate(prompts):
            for j in range(req.n):
                plans.append((i, ids, serving.sampling_params(req, max_tokens, len(ids), self.max_len, self.specials,
                                                              default_max_tokens, sample=j, structured=structured)))
        response_id = serving.new_request_id(kind)
        choices: list[Choice] = []
        try:
            for k, (i, ids, params) in enumerate(plans):
                rid = response_id if total == 1 else f"{response_id}-{k}"
                choices.append(Choice(k, ids, params, self.engine.generate(ids, params, rid,
                                                                           matchers[k] if matchers else None),
                                      prompt_texts[i] if prompt_texts else None))
        except BaseException:
            for c in choices:
                await c.stream.aclose()
            raise
        return response_id, choices
