"""Bearer-key authentication (`--api-key` / SPECFLEET_API_KEY), in front of every route but /health.

A pure ASGI middleware, so an unauthenticated request is refused before its body is read (and its
connection closed). /health stays open because load balancers and orchestrators probe it without
credentials. The key is compared with hmac.compare_digest, whose time does not depend on how many
leading characters were right.
"""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from specfleet.server.errors import APIError, send_error

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send_error(send, APIError(401, "missing or wrong API key: send the header "
                                             "'Authorization: Bearer <key>' with the key the server was started with",
                                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}),
                         close=True)  # the body is left unread: the connection cannot carry another request

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
