"""OpenAI-style error bodies, the mapping from our exceptions to HTTP statuses, and a body-size limit.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`, so the official
client raises its usual typed exceptions (BadRequestError, NotFoundError, RateLimitError, ...).
"""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specfleet.engine.async_engine import (EngineDeadError, EngineUnavailableError, QueueFullError,
                                           RequestFailedError, StreamStalledError)
from specfleet.errors import InvalidRequestError

logger = logging.getLogger("specfleet.server")

# the most bytes of an oversized body we read (and discard) so the client sees the 413 instead of
# a reset connection; past this we answer at once and let the connection drop
_DRAIN_LIMIT = 64 << 20


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields; raised anywhere in a handler."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class BodyTooLarge(Exception):
    pass


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes; send a shorter prompt",
                    code="request_too_large")


def api_error_from(exc: BaseException) -> APIError:
    """Map an exception from validation or the engine to the error the client receives."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    # the engine's own failures: a fixed text for the client, never the exception's (it can name internal
    # state, paths or data); the engine thread logged the detail with its traceback
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine failed and serves no more requests (the server log has the cause)",
                        "service_unavailable", code="engine_unavailable")
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), "service_unavailable", code="engine_unavailable")
    if isinstance(exc, RequestFailedError):
        return APIError(500, "the engine step that ran this request failed; the request was stopped and the "
                             "server goes on (the server log has the cause); retry it", "server_error",
                        code="engine_step_failed")
    if isinstance(exc, StreamStalledError):  # sent in-band (the stream's status line is out); 408 in /metrics
        return APIError(408, str(exc), "timeout_error", code="stream_stalled")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=getattr(exc, "param", None) or _param_of(str(exc)))
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, "internal server error (the server log has the cause)", "internal_error")


def _param_of(message: str) -> str | None:
    """SamplingParams words its errors 'invalid sampling parameter: NAME must ...'; recover NAME."""
    prefix = "invalid sampling parameter: "
    return message[len(prefix):].split(" ", 1)[0] if message.startswith(prefix) else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, _: BodyTooLarge) -> JSONResponse:
        return body_too_large(request.app.state.max_body_bytes).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # unknown routes (404) and wrong methods (405) get the same error shape as everything else
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return api_error_from(exc).response()


class MaxBodySizeMiddleware:
    """Refuse bodies over `max_bytes` with 413 before they are buffered, declared length or not."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _drain(receive, int(declared))
            await send_error(send, body_too_large(self.max_bytes), close=True)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    if message.get("more_body", False):
                        await _drain(receive, _DRAIN_LIMIT)
                    raise BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)


async def _drain(receive: Receive, limit: int) -> None:
    """Read and drop the rest of a request body (at most `limit` more bytes)."""
    read = 0
    while read <= min(limit, _DRAIN_LIMIT):
        message = await receive()
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def send_error(send: Send, error: APIError, close: bool = False) -> None:
    """Send `error` as a complete response from an ASGI middleware (no app or Request needed)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
