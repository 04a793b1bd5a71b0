"""`specfleet serve`: load the model and drafts, then serve the OpenAI-compatible API with uvicorn.

SIGTERM (and Ctrl-C) shut down gracefully: uvicorn stops accepting connections, new requests on open
connections get 503, and in-flight requests have --shutdown-timeout seconds to finish; the ones still
running then end with a 503 error of their own (a JSON body, or a final error event and [DONE] in a
stream; server/shutdown.py) and their engine requests are aborted. The app's lifespan then stops the
engine thread, and the process exits 0.

With --api-key (or SPECFLEET_API_KEY) every route but /health needs `Authorization: Bearer KEY`;
--allowed-origins lets browser apps on those origins call the API (CORS).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    from specfleet.llm import LLM
    from specfleet.server.app import ServerConfig

API_KEY_ENV = "SPECFLEET_API_KEY"


def _cpu_kernels(llm: LLM) -> str:
    """The start-up line's note of the CPU kernel path a model served on the CPU runs (or why there is none), empty
    on a GPU: which kernels made the logits matters when two processes' outputs are compared."""
    if llm.engine.device.type != "cpu":
        return ""
    from specfleet.runtime.backends.native import kernels

    if kernels.available():
        return f"; CPU kernels: {kernels.isa()}"
    return f"; CPU kernels unavailable: {kernels.unavailable_reason()}"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from specfleet.cli.common import add_engine_args

    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (printed at start)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="most requests waiting for their first token; more get HTTP 429")
    p.add_argument("--max-body-bytes", type=int, default=2 << 20, help="larger request bodies get HTTP 413")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM; then they end with a 503 error")
    p.add_argument("--stream-buffer", type=int, default=64,
                   help="updates a stream may hold for a client that does not read them (older ones are merged)")
    p.add_argument("--stream-stall-timeout", type=float, default=30.0,
                   help="seconds a stream's client may leave --stream-buffer updates unread; then its request is "
                        "stopped (KV freed) and the stream ends with a stream_stalled error")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                        f"{API_KEY_ENV} environment variable, which unlike this flag other users cannot see in ps)")
    p.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                   help="browser origins allowed by CORS, comma-separated or repeated (e.g. "
                        "https://app.example.com; * for any); default: no CORS headers")
    p.add_argument("--allowed-hosts", action="append", default=None, metavar="HOSTS",
                   help="without --api-key, Host names the server answers to besides localhost, IP addresses and "
                        "this machine's name (a guard against DNS rebinding), comma-separated or repeated; * for any")
    p.add_argument("--tokenizer-workers", type=int, default=2,
                   help="threads that tokenize prompts and compile grammars (off the event loop and the engine)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template replacing the model's own (for models without one, or to fix one); "
                        "`chatml-tools` names the shipped ChatML template with tool calling (Hermes / Qwen2.5 "
                        "syntax), for ChatML models whose own template has no tools (SmolLM2)")
    p.add_argument("--unenforceable-schema", default="refuse", choices=["refuse", "relax"],
                   help="a JSON schema keyword the grammar engine cannot enforce (uniqueItems, not, ...), in a "
                        "request that leaves `strict` unsaid: refuse it with a 400 naming it, or generate under the "
                        "rest of the schema and list it in the response's `structured_output.not_enforced`")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log one line per HTTP request")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/...)",
                              epilog="Scaling out: `specfleet cluster --replicas N -- SERVE-ARGS` runs N replicas of "
                                     "this server behind a cache-aware router (pip install 'specfleet[cluster]'); "
                                     "replicas on other machines join with --worker URL (docs/cluster.md).")
    add_serve_args(p)
    p.set_defaults(func=run_serve)
    return p


def _bind(host: str, port: int) -> socket.socket:
    """Bind before uvicorn starts, so `--port 0` can report the port it got."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from specfleet.errors import SpecfleetError
        raise SpecfleetError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port") from e
    return sock


def server_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerConfig:
    """The app's settings from the command line; the API key falls back to the environment."""
    from specfleet.server.app import ServerConfig
    from specfleet.server.chat import read_chat_template

    origins = tuple(o.strip() for arg in args.allowed_origins or [] for o in arg.split(",") if o.strip())
    return ServerConfig(args.served_model_name or args.model, args.max_queue, args.max_body_bytes,
                        args.shutdown_timeout, api_key=args.api_key or environ.get(API_KEY_ENV) or None,
                        allowed_origins=origins,
                        chat_template=read_chat_template(args.chat_template) if args.chat_template else None,
                        stream_buffer=args.stream_buffer, stream_stall_timeout_s=args.stream_stall_timeout,
                        unenforceable_schema=getattr(args, "unenforceable_schema", "refuse"),
                        tokenizer_workers=args.tokenizer_workers,
                        allowed_hosts=tuple(h.strip() for arg in args.allowed_hosts or [] for h in arg.split(",")
                                            if h.strip()))


def run_serve(args: argparse.Namespace, prepare: Callable[[LLM], None] | None = None) -> int:
    """Serve until SIGTERM; `prepare(llm)` runs once the model is loaded (the soak test injects a draft
    source that raises now and then, tools/soak.py)."""
    from specfleet.extras import require

    for module in ("fastapi", "pydantic", "prometheus_client"):
        require(module, "serve", "specfleet serve")
    uvicorn = require("uvicorn", "serve", "specfleet serve")

    from specfleet.cli.common import build_llm
    from specfleet.errors import SpecfleetError
    from specfleet.server.app import create_app
    from specfleet.server.shutdown import UVICORN_BACKSTOP_S, Drain
    from specfleet.server.worker import REQUEST_EXIT

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_queue < 1 or args.max_body_bytes < 1 or args.shutdown_timeout < 0 or args.stream_buffer < 1 \
            or args.tokenizer_workers < 1 \
            or not args.stream_stall_timeout >= 0:
        raise SpecfleetError("--max-queue, --max-body-bytes, --stream-buffer and --tokenizer-workers must be >= 1 "
                             "and --shutdown-timeout "
                             "and --stream-stall-timeout >= 0")
    config = server_config(args, os.environ)  # before the slow model load: bad settings fail at once
    sock = _bind(args.host, args.port)
    llm = build_llm(args)
    if prepare is not None:
        prepare(llm)
    app = create_app(llm, config)
    drain: Drain = app.state.drain

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, with the app's own drain running ahead of uvicorn's graceful timeout."""

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            timer = drain.begin()
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    host, port = sock.getsockname()[:2]
    print(f"specfleet: serving {config.model_name} on http://{host}:{port} "
          f"(context {llm.engine.max_model_len} tokens, {llm.engine.blocks.num_blocks} KV blocks"
          f"{_cpu_kernels(llm)}{'; API key required' if config.api_key else ''})", flush=True)
    # uvicorn's own timeout only backs ours up: it cancels what the drain could not end in time
    server = DrainingServer(uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log,
                                           timeout_graceful_shutdown=args.shutdown_timeout + UVICORN_BACKSTOP_S,
                                           lifespan="on"))
    # POST /drain (server/worker.py) starts the same graceful shutdown as SIGTERM
    setattr(app.state, REQUEST_EXIT, lambda: setattr(server, "should_exit", True))
    # uvicorn re-raises the signal it caught once its graceful shutdown is done; with the default
    # handler that would kill us with status -15 after a clean stop, so answer it with a no-op
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    print("specfleet: server stopped", flush=True)
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    from specfleet.errors import SpecfleetError

    parser = argparse.ArgumentParser(prog="python -m specfleet.server", description=__doc__.splitlines()[0])
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except SpecfleetError as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 2
