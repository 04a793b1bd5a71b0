"""Shared by the server tests: start the real server in a subprocess on 127.0.0.1 and talk to it.

Holds no tests. The server binds port 0 itself and prints the port it got, so there is no race for
a free port. Only loopback traffic: every URL here is http://127.0.0.1:PORT.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specfleet.bench.startup import logged_url, wait_healthy
from tests.conftest import real_model_path

MODEL = "smollm2-135m-instruct"
# small budgets keep the suite fast on two shared CPU cores; fp32 so greedy output matches offline exactly
COMMON_ARGS = ["--dtype", "float32", "--draft", "prompt-lookup", "--spec-len", "3", "--max-model-len", "384"]
STARTUP_TIMEOUT_S = 180


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def startup_line(self) -> str:
        """The server's "specfleet: serving ..." line (what it loaded: context, KV blocks, CPU kernels); "" before it."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return next((line for line in lines if line.startswith("specfleet: serving ")), "")

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {"name" or "name{k=v,...}": value}."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout_s: float = 15.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and every KV block is free; fails with the numbers if not."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if m["specfleet_requests_running"] == 0 and m["specfleet_requests_waiting"] == 0 \
                    and m["specfleet_kv_blocks_free"] == m["specfleet_kv_blocks_total"]:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout_s}s: running={m['specfleet_requests_running']} "
                                     f"waiting={m['specfleet_requests_waiting']} free={m['specfleet_kv_blocks_free']}"
                                     f"/{m['specfleet_kv_blocks_total']}")
            time.sleep(0.1)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server ignored SIGTERM for {timeout_s}s:\n{self.log_tail()}")


def launch_server(*extra_args: str, model: str = MODEL) -> ServerProcess:
    """Start the server process and return at once; `wait_ready` blocks until it answers /health. A later
    option in `extra_args` overrides the same one in COMMON_ARGS."""
    real_model_path(model)  # skips the test (or fails under SPECFLEET_REQUIRE_REAL=1) when not installed
    log = Path(tempfile.mkstemp(prefix="specfleet-server-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "specfleet.server", "--model", model, "--host", "127.0.0.1", "--port", "0",
           "--no-access-log", "--log-level", "warning", *COMMON_ARGS, *extra_args]
    # passive OpenMP waiting: on a shared two-core machine, spinning intra-op threads can make torch
    # ~20x slower on the main thread (measured), where the server loads its model
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return ServerProcess(proc, "", log)


def wait_ready(server: ServerProcess) -> ServerProcess:
    server.base_url = wait_healthy(server.proc, logged_url(server.log_path), STARTUP_TIMEOUT_S, server.log_tail)
    return server


def start_server(*extra_args: str) -> ServerProcess:
    return wait_ready(launch_server(*extra_args))


def tools_server(served: str, api_key: str):
    """A module's server for the tests that drive it with the official clients: SmolLM2 served as `served`,
    requiring `api_key`, with the shipped `chatml-tools` template (SmolLM2's own has no tools). A generator,
    for a module-scoped fixture to `yield from`."""
    server = start_server("--kv-cache-mb", "24", "--served-model-name", served, "--api-key", api_key,
                          "--chat-template", "chatml-tools")
    yield server
    stop_server(server)


def stop_server(server: ServerProcess) -> None:
    status = server.terminate()
    assert status == 0, f"server exited with {status} after SIGTERM:\n{server.log_tail()}"
    server.log_path.unlink(missing_ok=True)
