"""Waiting for a server process just started (specfleet's, or a native llama-server): the one loop behind
the benchmarks', the tools' and the tests' servers."""
from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from specfleet.errors import SpecfleetError


class ServerStartError(SpecfleetError):
    """A server process exited, or did not answer /health, before its start-up time ran out."""


def logged_url(log: Path) -> Callable[[], str]:
    """The base URL a specfleet server started on port 0 logs ("... on http://127.0.0.1:PORT"), "" until it has."""
    def find() -> str:
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        return found.group(1) if found else ""
    return find


def wait_healthy(proc: subprocess.Popen, url: str | Callable[[], str], timeout_s: float,
                 log_tail: Callable[[], str] = lambda: "", poll_s: float = 0.2) -> str:
    """Polls `url` + "/health" until it answers 200 and returns the base URL. `url` may be a function that gives
    it once known ("" before). Raises ServerStartError, with `log_tail()`, when the process exits first or when
    `timeout_s` seconds pass (the process is then killed)."""
    find = url if callable(url) else (lambda: url)
    base, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"{_name(proc)} exited with {proc.returncode} during start-up: {log_tail()}")
        base = base or find()
        if base:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    return base
            except httpx.HTTPError:
                pass
        time.sleep(poll_s)
    proc.kill()
    raise ServerStartError(f"{_name(proc)} did not answer /health within {timeout_s:.0f} s: {log_tail()}")


def _name(proc: subprocess.Popen) -> str:
    args = proc.args if isinstance(proc.args, (list, tuple)) else [proc.args]
    return Path(str(args[0])).name if args else "the server"
