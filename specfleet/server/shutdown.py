"""Graceful shutdown in which every request still gets a complete response.

uvicorn's own graceful shutdown (`timeout_graceful_shutdown`) cancels the request tasks still running
when it times out, and a cancelled handler answers nothing of its own: a non-streamed request gets a
plain-text 500 (and the log a traceback), a stream is cut off mid-body. So the server drains itself,
ahead of uvicorn:

    SIGTERM -> uvicorn stops listening and closes idle connections; `Drain.begin()`: requests that
    arrive from now on get 503, those in flight get `timeout_s` seconds to finish
    -> `Drain.abort()`: each request still running ends its own response with a 503 error (an OpenAI
    error body, or a final error event and `data: [DONE]` in a stream) and aborts its engine request
    -> the connections close, and uvicorn runs the app's lifespan shutdown.

`specfleet serve` sets uvicorn's timeout `UVICORN_BACKSTOP_S` past ours: it only fires for a response
that cannot be completed in that time (a client that stops reading, say).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, TypeVar

from specfleet.server.errors import APIError

T = TypeVar("T")
logger = logging.getLogger("specfleet.server")

UVICORN_BACKSTOP_S = 5.0


def shutting_down_error() -> APIError:
    return APIError(503, "the server is shutting down and accepts no new requests; retry on another "
                         "instance or later", "service_unavailable", code="shutting_down")


def aborted_error(timeout_s: float) -> APIError:
    return APIError(503, f"the server shut down before this request finished (in-flight requests had "
                         f"{timeout_s:g} s to finish); retry it", "service_unavailable", code="shutting_down")


class Drain:
    """The server's shutdown state; `race` is how a handler's waits give way to the abort."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.is_draining = False
        self._aborted: asyncio.Future[None] | None = None  # created in the serving loop, on first use
        self._num_racing = 0

    @property
    def is_aborted(self) -> bool:
        return self._aborted is not None and self._aborted.done()

    def check_accepting(self) -> None:
        """Raise the 503 for a request that arrives after shutdown began."""
        if self.is_draining:
            raise shutting_down_error()

    def begin(self) -> asyncio.TimerHandle:
        """Refuse new requests; abort the running ones in `timeout_s` (cancel the handle to not)."""
        self.is_draining = True
        return asyncio.get_running_loop().call_later(self.timeout_s, self.abort)

    def abort(self) -> None:
        aborted = self._future()
        if not aborted.done():
            if self._num_racing:
                logger.warning("shutdown: %d request(s) still running after %gs end with 503",
                               self._num_racing, self.timeout_s)
            aborted.set_result(None)

    async def race(self, work: Awaitable[T]) -> T:
        """Await `work`; if the abort comes first, cancel `work` and raise the 503 of an aborted request.

        Cancelling a wait on an engine stream aborts its engine request (see RequestStream).
        """
        task = asyncio.ensure_future(work)
        aborted = self._future()
        self._num_racing += 1
        try:
            await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller itself was cancelled: take `work` down with it
            task.cancel()
            raise
        finally:
            self._num_racing -= 1
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled():  # it ended on its own meanwhile; the abort still wins
            task.exception()  # retrieved, so asyncio does not log it as never retrieved
        raise aborted_error(self.timeout_s)

    def _future(self) -> asyncio.Future[None]:
        if self._aborted is None:
            self._aborted = asyncio.get_running_loop().create_future()
        return self._aborted
