"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine, plus /health, /metrics and vLLM's
/tokenize and /detokenize. `create_app` assembles it: the shared context (server/context.py: the
engine, the workers, the steps every request goes through), the middleware and the routes, each
endpoint in its own module, which shapes its own responses (server/routes.py).
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

from specfleet.llm import LLM
from specfleet.server.auth import ApiKeyMiddleware, HostAllowlistMiddleware
from specfleet.server.config import ServerConfig  # callers import it from here too
from specfleet.server.context import ServerContext
from specfleet.server.errors import MaxBodySizeMiddleware, install_error_handlers
from specfleet.server.routes import add_routes
from specfleet.server.stall import TRANSPORT_KEY, transport_of

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


def create_app(llm: LLM, config: ServerConfig) -> FastAPI:
    ctx = ServerContext(llm, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await ctx.start_engine()
        try:
            yield
        finally:  # uvicorn has already let in-flight responses finish (or cancelled them) by now
            await ctx.stop_engine()

    app = ServerApp(title="specfleet", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.max_body_bytes = config.max_body_bytes
    app.state.engine = ctx.engine
    app.state.admission = ctx.admission
    app.state.drain = ctx.drain  # `specfleet serve` starts it when uvicorn begins its shutdown
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
    add_routes(app, ctx)
    return app
