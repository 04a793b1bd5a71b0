"""Admission before any costly work: how many requests may be prepared at once, and a prompt length
check that needs no (or only bounded) tokenization.

A request is *prepared* from the moment its body is parsed until its choices are in the engine's
queue: tokenizing, rendering the chat template, compiling its grammar, all on the tokenizer workers.
Without a bound there, a burst of oversized requests fills the workers' queue and a 4-token request
waits behind all of them, only for them to be refused afterwards. So (as vLLM's and llama-server's
front ends bound their queues): requests being prepared count against the engine's `max_queue` with
those waiting for their first token, and one that would take that past `max_queue` (or the preparing
count past `max_preparing`) gets a 429 at once, before it is tokenized.

`PromptLengthBound` refuses prompts that cannot fit the context without tokenizing them whole: a
token's text is at most the longest token's bytes (times 4 for normalizers, which can shrink text),
so a prompt of more bytes than `max_model_len` such tokens hold is too long for sure; and a long
prompt is first tokenized only as far as a head of `HEAD_CHARS_PER_TOKEN` characters per context
token, refused if that head alone has too many tokens.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import math
import os
import threading
from typing import Any, Callable, Iterator

from specfleet.engine.async_engine import AsyncEngine, QueueFullError
from specfleet.server.errors import APIError

logger = logging.getLogger("specfleet.server")

LARGE_BODY_BYTES = 256 << 10  # bodies parsed off the event loop, after which the heap is trimmed
HEAD_CHARS_PER_TOKEN = 8  # a head this long per context token is tokenized first (bounded work)
_HEAD_MARGIN = 16  # tokens: a cut word can tokenize a little differently at the head's end


class Admission:
    """The count of requests being prepared (event loop only, so no lock)."""

    def __init__(self, engine: AsyncEngine, max_preparing: int):
        if max_preparing < 1:
            raise ValueError(f"max_preparing must be >= 1, got {max_preparing}")
        self.engine = engine
        self.max_preparing = max_preparing
        self.num_preparing = 0  # requests
        self._num_choices = 0  # their choices (each will take a place in the engine's queue)

    @contextlib.contextmanager
    def preparing(self, num_choices: int) -> Iterator[None]:
        queued = self.engine.num_queued + self._num_choices
        if queued + min(num_choices, self.engine.max_queue) > self.engine.max_queue:
            raise QueueFullError(f"{queued} requests are already waiting or being prepared "
                                 f"(max_queue={self.engine.max_queue}); retry later")
        if self.num_preparing >= self.max_preparing:
            raise QueueFullError(f"{self.num_preparing} requests are already being prepared (tokenized) "
                                 f"(max_preparing={self.max_preparing}); retry later")
        self.num_preparing += 1
        self._num_choices += num_choices
        try:
            yield
        finally:
            self.num_preparing -= 1
            self._num_choices -= num_choices


def longest_token_bytes(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes of any token's piece (an upper bound on the bytes of text one token covers,
    before normalization), or None without a tokenizer or its vocabulary."""
    if tokenizer is None:
        return None
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 -- a tokenizer without a readable vocabulary: no bound
        return None
    if not vocab:
        return None
    return max(len(piece.encode("utf-8", "surrogatepass")) for piece in vocab)


class PromptLengthBound:
    """See the module docstring. `check(text)` is O(len(text)); `encode(text, fn)` tokenizes a bounded
    head first when `text` is long."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.max_model_len = max_model_len
        longest = longest_token_bytes(tokenizer)
        # normalizers (NFKC) can turn up to 4 bytes into 1 (U+1D400 -> "A")
        self.max_bytes_per_token = None if longest is None else 4 * max(1, longest)
        self.head_chars = HEAD_CHARS_PER_TOKEN * (max_model_len + _HEAD_MARGIN)

    def _too_long(self, at_least: int) -> APIError:
        return APIError(400, f"the prompt has at least {at_least} tokens but the context holds "
                             f"{self.max_model_len}; shorten the prompt (nothing is truncated silently)",
                        param="prompt", code="context_length_exceeded")

    def check(self, text: str) -> None:
        """Refuse a text that holds more tokens than the context for sure, without tokenizing it."""
        if self.max_bytes_per_token is None or len(text) * 4 < self.max_bytes_per_token * self.max_model_len:
            return  # a UTF-8 character is at most 4 bytes: too few to decide on, skip the encode
        at_least = math.ceil(len(text.encode("utf-8", "surrogatepass")) / self.max_bytes_per_token)
        if at_least >= self.max_model_len:
            raise self._too_long(at_least)

    def encode(self, text: str, fn: Callable[[str], list[int]]) -> list[int]:
        """fn(text), unless a head of it already has too many tokens for the context (then a 400)."""
        if len(text) > self.head_chars:
            n = len(fn(text[:self.head_chars]))
            if n > self.max_model_len + _HEAD_MARGIN:
                raise self._too_long(n - _HEAD_MARGIN)
        return fn(text)


class HeapTrim:
    """Hands freed heap back to the system a moment after a large request (glibc's malloc_trim).

    glibc keeps what a multi-megabyte body, its parsed copy and its prompt text occupied in its arenas
    after they are freed (the worker threads' arenas too), so a burst of large requests, refused or not,
    would leave the server's resident memory raised for good. One trim runs at a time, on a worker
    thread, a second after the last large request; elsewhere than glibc this does nothing."""

    DELAY_S = 1.0

    def __init__(self) -> None:
        self._trim = None
        name = ctypes.util.find_library("c")
        try:
            self._trim = ctypes.CDLL(name).malloc_trim if name else None
        except (OSError, AttributeError):  # not glibc
            self._trim = None
        self._pending: asyncio.TimerHandle | None = None

    def after_large_request(self) -> None:
        if self._trim is None:
            return
        loop = asyncio.get_running_loop()
        if self._pending is not None:
            self._pending.cancel()
        self._pending = loop.call_later(self.DELAY_S, lambda: loop.run_in_executor(None, self._run))

    def _run(self) -> None:
        self._pending = None
        try:
            self._trim(0)
        except Exception:  # noqa: BLE001 -- memory housekeeping must never fail a request
            logger.debug("malloc_trim failed", exc_info=True)


BACKGROUND_NICE = 10  # niceness levels below the process's own (Linux caps it at 19)


def background_priority() -> None:
    """Run the calling thread (a tokenizer / grammar worker) at a lower CPU priority than the engine's.

    Compiling a large grammar or tokenizing a long prompt takes a core for seconds; the engine's forward
    passes run on every core (torch's threads), and one of them waiting for a core stalls the whole step,
    so every stream would pay for one client's grammar. Ten levels below the process (relative, so a server
    started under `nice` keeps its workers below its engine) the kernel gives the engine's threads the core
    first. Linux sets it per thread; elsewhere (or without the right) this does nothing."""
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, own + BACKGROUND_NICE))
    except (AttributeError, OSError):
        pass


def idle_priority() -> None:
    """Run the calling thread (the worker that compiles large grammars) only when a core is otherwise idle.

    A megabyte regex compiles for seconds; at nice 10 that thread still gets its share of a core when
    the engine's threads want both, and each slice it takes stalls a whole step (the probe measured the
    longest inter-token gaps while one compiled). Linux's SCHED_IDLE runs it only on time nobody else
    wants, and the engine leaves such time between steps. Only large grammars go there, so normal
    requests' tokenizing is never starved by a busy engine; elsewhere (or without the call) nice 10."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        background_priority()
