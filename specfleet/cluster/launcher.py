"""Start N `specfleet serve` replicas and the SGLang Model Gateway (`smg`) in front of them; keep them up.

The router is smg's (`pip install 'specfleet[cluster]'`), run as its own process: specfleet writes no
routing policy. Its `cache_aware` policy keeps an approximate radix tree of the request text each
worker has seen and sends a request to the worker holding the longest matching prefix (when the match
is at least `--cache-threshold` of the request), else to the worker with the least cached text, and
falls back to the least loaded worker when the load is imbalanced. A conversation's next turn carries
its earlier turns as a prefix, so it lands on the replica that has those turns in its KV prefix cache
and in its suffix draft's tree.

Replicas here are child processes on this machine (`python -m specfleet.server ARGS --host H --port P`,
each with its own OMP thread count); replicas on other machines are given by URL and only routed to.
The supervisor restarts a local replica that exits unexpectedly (on the same port; the router's
health checks re-admit it), and stops everything in order on SIGTERM or Ctrl-C: the router first (no
new requests; it lets its in-flight responses finish), then each replica by SIGTERM (its graceful
drain, server/shutdown.py).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specfleet.errors import SpecfleetError

logger = logging.getLogger("specfleet.cluster")

POLICIES = ("cache_aware", "round_robin", "power_of_two", "least_load", "random", "prefix_hash",
            "consistent_hashing")


@dataclass
class ClusterConfig:
    replicas: int  # local replicas started here
    serve_args: list[str]  # passed to every local replica's `specfleet serve` (not --host/--port)
    workers: list[str] = field(default_factory=list)  # replicas elsewhere, by URL (started by their owner)
    host: str = "127.0.0.1"  # the router's address
    port: int = 8000  # the router's port; local replicas take the ports after it unless replica_port is set
    replica_host: str = "127.0.0.1"
    replica_port: int | None = None
    threads_per_replica: int | None = None  # OMP_NUM_THREADS of each local replica (None: inherited)
    policy: str = "cache_aware"
    router_metrics_port: int | None = None  # smg's own Prometheus port (default: after the replicas' ports)
    router_args: list[str] = field(default_factory=list)  # more smg flags, as given
    health_interval_s: int = 2  # smg's health probes; a dead replica is out after 2 misses
    restart: bool = True
    shutdown_grace_s: float = 30.0  # how long the router lets its in-flight responses finish on stop
    ready_timeout_s: float = 900.0
    log_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the replicas

    def check(self) -> None:
        if self.replicas < 0 or (self.replicas == 0 and not self.workers):
            raise SpecfleetError("a cluster needs at least one replica: --replicas N (N >= 1) or --worker URL")
        if self.policy not in POLICIES:
            raise SpecfleetError(f"unknown --policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        for arg in self.serve_args:
            if arg.split("=")[0] in ("--host", "--port"):
                raise SpecfleetError(f"{arg.split('=')[0]} is set by the cluster for each replica; use "
                                     f"--replica-host/--replica-port (and --host/--port for the router)")
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise SpecfleetError(f"--worker {url!r} is not a URL; give it as http://HOST:PORT")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise SpecfleetError(f"--threads-per-replica must be >= 1, got {self.threads_per_replica}")

    def replica_ports(self) -> list[int]:
        first = self.replica_port if self.replica_port is not None else self.port + 1
        return [first + i for i in range(self.replicas)]

    def metrics_port(self) -> int:
        if self.router_metrics_port is not None:
            return self.router_metrics_port
        return max([self.port, *self.replica_ports()]) + 1


class Replica:
    """One local `specfleet serve` child process."""

    def __init__(self, index: int, host: str, port: int, argv: list[str], env: dict[str, str], log_path: Path):
        self.index, self.host, self.port, self.argv, self.env, self.log_path = index, host, port, argv, env, log_path
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_path, "ab")  # noqa: SIM115 -- the child keeps it; closed with our copy below
        try:
            log.write(f"--- start {self.starts}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        finally:
            log.close()

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _get(url: str, timeout: float = 2.0, api_key: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:  # noqa: S310 -- our own http URLs
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, b""


def replica_api_key(config: ClusterConfig) -> str | None:
    """The key the replicas require (their --api-key, else the environment's SPECFLEET_API_KEY)."""
    args = config.serve_args
    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    return config.env.get("SPECFLEET_API_KEY") or os.environ.get("SPECFLEET_API_KEY") or None


def router_command(config: ClusterConfig, worker_urls: list[str]) -> list[str]:
    """smg's command line: the chosen policy over every worker, probes often enough to notice a dead
    replica in seconds, and its metrics on the router's host (smg's default binds every interface).
    With replicas that need an API key, smg gets it too (`--api-key`: it then sends it to the workers
    and asks it of its clients)."""
    key = replica_api_key(config)
    return [sys.executable, "-m", "smg", "launch", "--host", config.host, "--port", str(config.port),
            "--worker-urls", *worker_urls, "--policy", config.policy,
            "--prometheus-host", config.host, "--prometheus-port", str(config.metrics_port()),
            "--health-check-interval-secs", str(config.health_interval_s),
            "--load-monitor-interval", str(config.health_interval_s),  # /v1/loads, for the balance gate
            "--health-failure-threshold", "2", "--health-success-threshold", "1",
            "--shutdown-grace-period-secs", str(int(config.shutdown_grace_s)),
            "--log-level", "warn", *(["--api-key", key] if key else []), *config.router_args]


class Cluster:
    def __init__(self, config: ClusterConfig):
        config.check()
        self.config = config
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="specfleet-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **config.env)
        if config.threads_per_replica is not None:
            env["OMP_NUM_THREADS"] = str(config.threads_per_replica)
        self.replicas = [
            Replica(i, config.replica_host, port,
                    [sys.executable, "-m", "specfleet.server", *config.serve_args,
                     "--host", config.replica_host, "--port", str(port)],
                    env, self.log_dir / f"replica-{i}.log")
            for i, port in enumerate(config.replica_ports())]
        self.router: subprocess.Popen | None = None
        self.router_log = self.log_dir / "router.log"
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.config.port}"

    @property
    def worker_urls(self) -> list[str]:
        return [r.url for r in self.replicas] + list(self.config.workers)

    # -- start -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the replicas, wait until each answers /health, then start the router and wait for it."""
        try:
            import smg  # noqa: F401 -- only to fail early with the install hint
        except ImportError as e:
            raise SpecfleetError("specfleet cluster runs the SGLang Model Gateway, which is not installed: "
                                 "pip install 'specfleet[cluster]'") from e
        try:
            for r in self.replicas:
                r.start()
            deadline = time.monotonic() + self.config.ready_timeout_s
            for r in self.replicas:
                self._wait_healthy(r, deadline)
            self.start_router()
            self._wait_router(deadline)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, r: Replica, deadline: float) -> None:
        while time.monotonic() < deadline:
            code = r.exited()
            if code is not None:
                raise SpecfleetError(f"replica {r.index} ({r.url}) exited with status {code} while starting; "
                                     f"its log {r.log_path} ends:\n{r.log_tail()}")
            if _get(r.url + "/health")[0] == 200:
                return
            time.sleep(0.25)
        raise SpecfleetError(f"replica {r.index} ({r.url}) did not become healthy within "
                             f"{self.config.ready_timeout_s:g}s; see {r.log_path}")

    def start_router(self) -> None:
        argv = router_command(self.config, self.worker_urls)
        log = open(self.router_log, "ab")  # noqa: SIM115
        try:
            log.write(f"--- {' '.join(argv)}\n".encode())
            log.flush()
            self.router = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        finally:
            log.close()

    def _wait_router(self, deadline: float) -> None:
        """Until the router has every worker that answers /health registered and healthy."""
        want = {u for u in self.worker_urls if _get(u + "/health")[0] == 200}
        while time.monotonic() < deadline:
            if self.router is not None and self.router.poll() is not None:
                raise SpecfleetError(f"the router exited with status {self.router.returncode} while starting; "
                                     f"see {self.router_log}")
            if want <= self.healthy_workers():
                return
            time.sleep(0.25)
        raise SpecfleetError(f"the router did not register its workers within {self.config.ready_timeout_s:g}s; "
                             f"see {self.router_log}")

    def healthy_workers(self) -> set[str]:
        """Worker URLs the router lists as healthy (its GET /workers)."""
        code, body = _get(self.url + "/workers", api_key=replica_api_key(self.config))
        if code != 200:
            return set()
        try:
            workers = json.loads(body).get("workers", [])
        except ValueError:
            return set()
        return {w.get("url") for w in workers if w.get("is_healthy", w.get("healthy", False))}

    # -- run -----------------------------------------------------------------------------------------
    def supervise(self, poll_s: float = 0.5) -> int:
        """Until stop() (or the router dies): restart local replicas that exit. Returns an exit status."""
        while not self._stopping.wait(poll_s):
            if self._stopping.is_set():  # set by a signal handler during the wait, which can still time out
                break
            if self.router is not None and self.router.poll() is not None:
                logger.error("the router exited with status %s; stopping the replicas (see %s)",
                             self.router.returncode, self.router_log)
                self.stop()
                return 1
            for r in self.replicas:
                code = r.exited()
                if code is not None and not self._stopping.is_set():
                    if self.config.restart:
                        logger.warning("replica %d (%s) exited with status %s; restarting it (start %d; log %s)",
                                       r.index, r.url, code, r.starts + 1, r.log_path)
                        r.start()
                    else:
                        logger.warning("replica %d (%s) exited with status %s; not restarted (--no-restart)",
                                       r.index, r.url, code)
                        r.proc = None
        return 0

    # -- stop ----------------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 60.0) -> None:
        """Router first (stops taking requests, finishes what it forwards), then the replicas' drain."""
        self._stopping.set()
        if self.router is not None and self.router.poll() is None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        live = [r for r in self.replicas if r.exited() is None and r.proc is not None]
        for r in live:
            r.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for r in live:
            try:
                r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
