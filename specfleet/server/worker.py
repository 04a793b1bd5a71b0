"""What a router in front of several replicas reads from each one (docs/cluster.md).

A cache-aware router such as the SGLang Model Gateway (`smg`, `specfleet cluster`) needs three
things from a worker besides `/health` and the OpenAI routes:

- `GET /server_info`: what this replica serves: model id, context length, KV cache shape, the draft
  composition and its speculation length, queue bound, version. A router (smg probes it while it
  registers a worker) or an operator learns the context length here without a request.
- `GET /v1/loads`: the load snapshot in the shape SGLang's engines answer (`{"loads": [{...}]}`, one
  entry, `dp_rank` 0): running and waiting requests, KV usage (`token_usage`, 0..1, and in tokens),
  prefix-cache hit rate. smg's load monitor polls this route (a report with a non-numeric field in a
  load entry, a null say, is dropped by smg without a word, so entries hold numbers only); its load-aware policies (`cache_aware`'s balance gate,
  `power_of_two`, `least_load`) and overload protection read it. The same numbers are in `/metrics`
  (`specfleet_requests_running`, `specfleet_requests_waiting`, `specfleet_kv_cache_usage_ratio`,
  `specfleet_prefix_cache_hit_tokens_total`, ...) for Prometheus.
- `POST /drain`: graceful drain by HTTP, for an operator or a script on another machine (no signal
  needed): the replica stops listening (a router sees it gone and sends new requests elsewhere),
  lets its running requests finish within `--shutdown-timeout`, then exits, exactly as on SIGTERM
  (server/shutdown.py). With `--api-key` it needs the key like every route but /health.

Nothing here changes how a request is served; these routes only read the engine's published snapshot.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from specfleet.engine.async_engine import AsyncEngine
from specfleet.llm import LLM
from specfleet.server.errors import APIError
from specfleet.server.shutdown import Drain

# set on app.state by whoever runs the app under a server that can stop itself (cli/serve.py): a
# callable that starts the graceful shutdown, as SIGTERM would
REQUEST_EXIT = "request_exit"


def _version() -> str | None:
    try:
        return version("specfleet")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return None


def server_info(llm: LLM, engine: AsyncEngine, model_name: str) -> dict[str, Any]:
    eng = llm.engine
    snap = engine.snapshot
    return {
        "model": model_name,
        "model_path": str(llm.model_name),
        "max_model_len": eng.max_model_len,
        "context_length": eng.max_model_len,  # SGLang's name for it
        "vocab_size": llm.model.config.vocab_size,
        "draft": None if llm.draft_name is None else str(llm.draft_name),
        "num_speculative_tokens": snap.num_speculative_tokens,
        "kv_cache": {"num_blocks": eng.blocks.num_blocks, "block_size": eng.blocks.block_size,
                     "prefix_caching": eng.blocks.enable_caching},
        "max_queue": engine.max_queue,
        "device": str(llm.device),
        "version": _version(),
    }


def loads(llm: LLM, engine: AsyncEngine, drain: Drain) -> dict[str, Any]:
    """One load report in the shape of SGLang's /v1/loads: a top level with an ISO timestamp and
    `dp_rank_count`, and per rank only numeric fields under SGLang's names (smg reads them into typed
    fields, and stops polling a worker whose report does not parse). specfleet's own additions sit
    under "specfleet"."""
    snap = engine.snapshot
    block_size = llm.engine.blocks.block_size
    used_blocks = snap.num_blocks - snap.num_free_blocks
    hit_rate = snap.prefix_hit_tokens / snap.prefix_queried_tokens if snap.prefix_queried_tokens else 0.0
    now = time.time()
    return {
        "timestamp": datetime.fromtimestamp(now, timezone.utc).isoformat(),
        "version": f"specfleet-{_version() or 'source'}",
        "dp_rank_count": 1,
        "loads": [{
            "timestamp": now,
            "dp_rank": 0,
            "num_running_reqs": snap.num_running,
            "num_waiting_reqs": snap.num_waiting,
            "num_used_tokens": used_blocks * block_size,  # KV slots held (whole blocks)
            "num_total_tokens": used_blocks * block_size,
            "max_total_num_tokens": snap.num_blocks * block_size,
            "max_running_requests": llm.engine.scheduler.max_num_seqs,
            "token_usage": used_blocks / snap.num_blocks if snap.num_blocks else 0.0,
            "cache_hit_rate": hit_rate,
        }],
        "specfleet": {
            "num_queued_reqs": engine.num_queued,  # admitted, no token yet (the 429 bound counts these)
            "prefix_hit_tokens": snap.prefix_hit_tokens,
            "prefix_queried_tokens": snap.prefix_queried_tokens,
            "healthy": engine.is_healthy,
            "draining": drain.is_draining,
        },
    }


def add_worker_routes(app: FastAPI, llm: LLM, engine: AsyncEngine, drain: Drain, model_name: str) -> None:
    @app.get("/server_info")
    async def server_info_route() -> Response:
        return JSONResponse(server_info(llm, engine, model_name))

    @app.get("/v1/loads")
    async def loads_route() -> Response:
        return JSONResponse(loads(llm, engine, drain))

    @app.post("/drain")
    async def drain_route() -> Response:
        request_exit: Callable[[], None] | None = getattr(app.state, REQUEST_EXIT, None)
        if request_exit is None:
            raise APIError(501, "this app was not started by `specfleet serve`, so it cannot stop itself; "
                                "stop it the way it was started", "not_implemented", code="drain_unavailable")
        already = drain.is_draining
        request_exit()
        return JSONResponse({"status": "draining", "already_draining": already,
                             "shutdown_timeout_s": drain.timeout_s}, status_code=202)
