"""Bearer-key authentication (`--api-key` / SPECFLEET_API_KEY), in front of every route but /health.

A pure ASGI middleware, so an unauthenticated request is refused before its body is read (and its
connection closed). /health stays open because load balancers and orchestrators probe it without
credentials. The key is compared with hmac.compare_digest, whose time does not depend on how many
leading characters were right. Without a key the Host header is checked instead (HostAllowlistMiddleware).
"""
from __future__ import annotations

import hmac
import ipaddress
import socket

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


def _host_name(header: bytes) -> str:
    """The name in a Host header, lower-cased, without its port ("[::1]:8000" -> "::1")."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):  # an IPv6 literal
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostAllowlistMiddleware:
    """Without an API key, only requests whose Host names this machine are served (403 otherwise), as
    Ollama does. A web page a browser loads can make its own domain resolve to 127.0.0.1 (DNS rebinding)
    and then talk to a keyless server on loopback as if it were the same site; its requests still carry
    that domain in Host. Allowed: no Host (HTTP/1.0), an IP address, `localhost` and `*.localhost`, this
    machine's host name, and the names given with --allowed-hosts (`*`: any)."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...] = ()):
        self.app = app
        self.any = "*" in allowed_hosts
        self.allowed = {h.strip().lower() for h in allowed_hosts if h.strip()} | {"localhost"}
        try:
            self.allowed.add(socket.gethostname().lower())
        except OSError:  # pragma: no cover - no host name: only the others
            pass

    def allows(self, host: str) -> bool:
        return self.any or not host or host in self.allowed or host.endswith(".localhost") or _is_ip(host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = _host_name(dict(scope["headers"]).get(b"host", b""))
        if self.allows(host):
            await self.app(scope, receive, send)
            return
        await send_error(send, APIError(403, f"the Host header {host[:100]!r} is not one this server answers to "
                                             f"without an API key; start it with --allowed-hosts {host[:100]} "
                                             f"(or --api-key) to allow it", code="host_not_allowed"), close=True)
