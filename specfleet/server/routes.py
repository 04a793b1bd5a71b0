"""The server's routes: each endpoint's handler (its own module) bound to the shared ServerContext."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specfleet.server import tokens
from specfleet.server.chat_completions import chat_completions
from specfleet.server.completions import completions
from specfleet.server.context import ServerContext
from specfleet.server.errors import APIError
from specfleet.server.worker import add_worker_routes


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    app.add_api_route("/v1/completions", _bound(completions, ctx), methods=["POST"])
    app.add_api_route("/v1/chat/completions", _bound(chat_completions, ctx), methods=["POST"])
    app.add_api_route("/tokenize", _bound(tokens.tokenize, ctx), methods=["POST"])
    app.add_api_route("/detokenize", _bound(tokens.detokenize, ctx), methods=["POST"])

    model_card = {"id": ctx.config.model_name, "object": "model", "created": 0, "owned_by": "specfleet",
                  "max_model_len": ctx.max_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")  # `:path`: a model id may hold slashes (a folder path)
    async def model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)
        return model_card

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: the same status, no body
    async def health() -> Response:
        if ctx.engine.is_healthy:
            return JSONResponse({"status": "ok"})
        # the cause (an exception's text) is in the server log, not for whoever can reach /health
        reason = "engine failed (the server log has the cause)" if ctx.engine.error else "shutting down"
        return APIError(503, reason, "service_unavailable").response()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # /server_info, /v1/loads, /drain (for routers)
    add_worker_routes(app, ctx.llm, ctx.engine, ctx.drain, ctx.config.model_name)


def _bound(handler, ctx: ServerContext):
    async def route(request: Request) -> Response:
        return await handler(ctx, request)
    route.__name__ = handler.__name__
    route.__doc__ = handler.__doc__
    return route
