"""A streamed response whose client stops reading is stopped, however much the sockets buffer.

The AsyncEngine stops a request whose stream buffer stays full (async_engine.py), but that buffer only
fills once the ASGI `send` blocks, and over real TCP it blocks late: the client's receive buffer, the
server's send buffer (Linux grows it to megabytes) and the transport's 64 KiB all take the stream
first, minutes of tokens at SSE's ~150 bytes a token. So each streamed response also watches its
connection from the kernel's side: bytes waiting to go out (the transport's buffer and the socket's
send queue, SIOCOUTQ) while the client acknowledges nothing new (TCP_INFO's bytes_acked). When no byte
has been taken for `stream_stall_timeout_s` with bytes waiting, the connection is reset, which ends
the response and so aborts its engine requests (the response's close does, server/streaming.py), and the stall is
counted as the engine's are (`specfleet_stalled_streams`). A client that reads, however slowly, is
left alone: each acknowledged byte restarts the clock. What the client's kernel takes before its
receive window closes cannot be seen from here: the clock starts when the window closes.

Reaching the socket: ASGI gives an app no transport. uvicorn's `send` is a bound method of its request
cycle, which holds the connection's transport; `transport_of` takes it from there (ServerApp puts it in
the scope before Starlette wraps `send`). Under another server, or off Linux, nothing is watched and
the engine-side guard alone applies.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios
import time
from typing import Any, Callable

logger = logging.getLogger("specfleet.server")

TRANSPORT_KEY = "specfleet.transport"  # the scope key ServerApp stores the connection's transport under

_TCP_INFO_LEN = 256
_BYTES_ACKED_OFFSET = 120  # struct tcp_info: 8 one-byte fields, 24 u32, pacing_rate, max_pacing_rate, bytes_acked
_OUTQ = getattr(termios, "TIOCOUTQ", None)  # SIOCOUTQ: bytes in the send queue, not yet acknowledged


def transport_of(send: Callable[..., Any]) -> asyncio.Transport | None:
    """The connection's transport behind an ASGI `send`, where the server is uvicorn; else None."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    needed = ("get_extra_info", "get_write_buffer_size", "abort", "is_closing")
    return transport if all(hasattr(transport, name) for name in needed) else None


class SocketProgress:
    """Reads, for one TCP connection, the bytes its peer has acknowledged and the bytes still waiting
    (the transport's buffer plus the kernel's unacknowledged send queue)."""

    def __init__(self, transport: asyncio.Transport, sock: Any):
        self.transport = transport
        self.sock = sock  # asyncio's TransportSocket: getsockopt and fileno, nothing that could disturb it

    @classmethod
    def of(cls, transport: asyncio.Transport | None) -> SocketProgress | None:
        """None where this cannot be measured: no transport, not TCP, or a kernel without the calls."""
        if transport is None or _OUTQ is None or not hasattr(socket, "TCP_INFO"):
            return None
        sock = transport.get_extra_info("socket")
        if sock is None or sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        progress = cls(transport, sock)
        try:
            progress.read()
        except OSError:
            return None
        return progress

    def read(self) -> tuple[int, int]:
        """(bytes acknowledged by the peer so far, bytes waiting to be taken)."""
        info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        if len(info) < _BYTES_ACKED_OFFSET + 8:
            raise OSError("TCP_INFO has no bytes_acked on this kernel")
        acked = struct.unpack_from("Q", info, _BYTES_ACKED_OFFSET)[0]
        queued = struct.unpack("i", fcntl.ioctl(self.sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
        return acked, queued + self.transport.get_write_buffer_size()


    def reset(self) -> None:
        """Close the connection with a reset, dropping what the kernel still holds for it (up to
        megabytes that this client would never take; a plain close would keep them queued)."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.transport.abort()


class StallGuard:
    """Watches the connections of streamed responses; counts and aborts those whose client stopped."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.num_stalled = 0  # connections aborted because their client took nothing for timeout_s

    def watch(self, scope: dict[str, Any]) -> asyncio.Task | None:
        """Start watching the response of `scope`'s connection; cancel the task when the response ends.
        None where the connection cannot be measured (then only the engine-side guard applies)."""
        transport = scope.get(TRANSPORT_KEY)
        progress = SocketProgress.of(transport) if self.timeout_s > 0 else None
        if progress is None:
            return None
        return asyncio.ensure_future(self._watch(progress))

    async def _watch(self, progress: SocketProgress) -> None:
        period = min(1.0, self.timeout_s / 4)
        acked, _ = progress.read()
        since = time.monotonic()  # when the client last took a byte, or had nothing waiting
        while not progress.transport.is_closing():
            await asyncio.sleep(period)
            try:
                now_acked, waiting = progress.read()
            except OSError:  # the socket is gone: nothing left to watch
                return
            now = time.monotonic()
            if waiting == 0 or now_acked != acked:
                acked, since = now_acked, now
            elif now - since >= self.timeout_s:
                self.num_stalled += 1
                logger.warning("a streamed response's client took none of %d waiting bytes for %.1f s (limit "
                               "%g s, --stream-stall-timeout); its connection is closed and its request stopped",
                               waiting, now - since, self.timeout_s)
                progress.reset()  # the response ends on the disconnect, which aborts its requests
                return
