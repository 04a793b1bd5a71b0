"""Prometheus metrics: request counters kept by the server, engine state read from its snapshot.

Engine-side numbers (queue, KV blocks, speculation) are not pushed every step: a collector reads the
AsyncEngine's latest immutable snapshot at scrape time, so the engine thread never touches
prometheus objects. Speculation metrics follow the conventions of `specfleet/core/stats.py`.
Each app gets its own registry, so several apps (tests) can live in one process.

Per-draft metrics appear when the proposer exposes them (composite proposers: voting, selection):
`proposer.weights: Mapping[str, float]` and `proposer.draft_stats: Mapping[str, SpecStats | Mapping]`
(a mapping with "drafted" and "accepted" counts). For every proposer, tokens accepted per draft are
counted from each finished request's token origins.
"""
from __future__ import annotations

import logging
from typing import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specfleet.engine.async_engine import AsyncEngine
from specfleet.outputs import RequestOutput
from specfleet.core.stats import SpecStats
from specfleet.server.stall import StallGuard

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
# Unknown field names come from clients: at most this many get their own label (and log line), the
# rest share OTHER_FIELD, so a client cannot grow the registry or the log without bound.
MAX_UNKNOWN_FIELD_LABELS = 64
MAX_FIELD_LABEL_CHARS = 64
OTHER_FIELD = "_other"

logger = logging.getLogger("specfleet.server")


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, stall_guard: StallGuard | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specfleet_requests", "Finished or rejected API requests",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("specfleet_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter("specfleet_generation_tokens", "Tokens generated for served requests",
                                         registry=r)
        self.accepted_by_draft = Counter("specfleet_spec_accepted_tokens_by_draft",
                                         "Output tokens that a draft proposed and the target accepted",
                                         ["draft"], registry=r)
        self.latency = Histogram("specfleet_request_latency_seconds", "Arrival to last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specfleet_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.unknown_fields = Counter("specfleet_unknown_request_fields",
                                      "Requests that carried a field this server does not know (accepted, ignored)",
                                      ["field"], registry=r)
        self._unknown_seen: set[str] = set()
        self.schema_notes = Counter("specfleet_json_schema_keywords",
                                    "JSON schema keywords and formats of served requests that were not fully "
                                    "enforced: kind annotation (unknown keyword, format without a grammar), "
                                    "narrowed, or not_enforced (strict=false)", ["kind", "name"], registry=r)
        self._schema_seen: set[tuple[str, str]] = set()
        r.register(_EngineCollector(engine, stall_guard))

    def observe_finished(self, endpoint: str, out: RequestOutput) -> None:
        self.requests.labels(endpoint, out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        for origin in set(out.token_origins) - {"target"}:
            self.accepted_by_draft.labels(origin).inc(out.token_origins.count(origin))
        if "latency_s" in out.metrics:
            self.latency.observe(out.metrics["latency_s"])
        if "ttft_s" in out.metrics:
            self.ttft.observe(out.metrics["ttft_s"])
        for kind, notes in (out.metrics.get("structured_output") or {}).items():
            for name in {n.split(" at ", 1)[0].split(" (", 1)[0] for n in notes}:  # once per name and request
                self.observe_schema_note(kind.rstrip("s"), name)

    def observe_schema_note(self, kind: str, name: str) -> None:
        """Count a schema keyword or format (`format:NAME`) that was not fully enforced; names come from
        clients' schemas, so at most MAX_UNKNOWN_FIELD_LABELS get their own label."""
        key = (kind, name[:MAX_FIELD_LABEL_CHARS])
        if key not in self._schema_seen:
            if len(self._schema_seen) >= MAX_UNKNOWN_FIELD_LABELS:
                key = (kind, OTHER_FIELD)
            else:
                self._schema_seen.add(key)
        self.schema_notes.labels(*key).inc()

    def observe_rejected(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, f"http_{status}").inc()

    def observe_unknown_field(self, endpoint: str, field: str) -> None:
        """Count an ignored unknown field; log its name the first time it is seen, so an operator learns
        what clients send without a log line per request."""
        label = field[:MAX_FIELD_LABEL_CHARS]
        if label not in self._unknown_seen:
            if len(self._unknown_seen) >= MAX_UNKNOWN_FIELD_LABELS:
                label = OTHER_FIELD
            else:
                self._unknown_seen.add(label)
                logger.warning("ignoring unknown request field %r (first seen on %s; counted in "
                               "specfleet_unknown_request_fields_total)", label, endpoint)
        self.unknown_fields.labels(label).inc()


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, stall_guard: StallGuard | None = None):
        self.engine = engine
        self.stall_guard = stall_guard  # stalls seen at the socket (server/stall.py), besides the engine's

    def collect(self) -> Iterator[Metric]:
        snap = self.engine.snapshot
        s = snap.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge("specfleet_requests_running", "Requests in the running batch", snap.num_running)
        yield gauge("specfleet_requests_waiting", "Requests in the engine's waiting queue", snap.num_waiting)
        yield gauge("specfleet_queue_length", "Admitted requests still waiting for their first token",
                    self.engine.num_queued)
        yield gauge("specfleet_queue_capacity", "Most requests that may wait before 429", self.engine.max_queue)
        yield gauge("specfleet_kv_blocks_total", "KV cache blocks of the target", snap.num_blocks)
        yield gauge("specfleet_kv_blocks_free", "KV cache blocks of the target that no running request holds "
                    "(free, or cached prefixes evicted on demand)", snap.num_free_blocks)
        usage = 1.0 - snap.num_free_blocks / snap.num_blocks if snap.num_blocks else 0.0
        yield gauge("specfleet_kv_cache_usage_ratio", "Fraction of KV blocks held by running requests", usage)
        yield gauge("specfleet_prefix_cache_blocks", "KV blocks registered in the prefix cache (held or not)",
                    snap.num_cached_blocks)
        yield CounterMetricFamily("specfleet_prefix_cache_queried_tokens",
                                  "Tokens of admitted requests looked up in the prefix cache",
                                  value=snap.prefix_queried_tokens)
        yield CounterMetricFamily("specfleet_prefix_cache_hit_tokens",
                                  "Tokens found in the prefix cache (not prefilled again)",
                                  value=snap.prefix_hit_tokens)
        hit_rate = snap.prefix_hit_tokens / snap.prefix_queried_tokens if snap.prefix_queried_tokens else 0.0
        yield gauge("specfleet_prefix_cache_hit_rate", "hit tokens / queried tokens since the start", hit_rate)
        yield CounterMetricFamily("specfleet_prefix_cache_evictions", "Cached blocks evicted to make room",
                                  value=snap.prefix_evictions)
        yield gauge("specfleet_kv_blocks_held", "KV blocks held by live requests (0 when idle, else a leak)",
                    snap.num_held_blocks)
        yield gauge("specfleet_engine_requests", "Requests the engine holds (running or waiting)", snap.num_requests)
        yield gauge("specfleet_engine_healthy", "1 while the engine accepts requests", float(self.engine.is_healthy))
        yield CounterMetricFamily("specfleet_engine_step_failures", "Engine steps whose batch failed; their "
                                  "requests were stopped and the engine went on", value=snap.num_step_failures)
        yield CounterMetricFamily("specfleet_engine_failed_requests", "Requests stopped by a failed engine step",
                                  value=snap.num_failed_requests)
        yield CounterMetricFamily("specfleet_stalled_streams", "Streams stopped because the client read too "
                                  "slowly (--stream-stall-timeout)", value=self.engine.num_stalled_streams + (
                                      self.stall_guard.num_stalled if self.stall_guard else 0))
        yield CounterMetricFamily("specfleet_spec_draft_failures", "Proposer calls that raised (their requests "
                                  "went on by plain decoding)", value=s.num_draft_failures)
        yield CounterMetricFamily("specfleet_spec_draft_fallback_requests", "Requests that a proposer failure "
                                  "turned to plain decoding", value=s.num_draft_fallbacks)
        yield CounterMetricFamily("specfleet_engine_steps", "Engine steps (target forward passes)",
                                  value=snap.num_engine_steps)
        yield CounterMetricFamily("specfleet_spec_steps", "Verification steps (decode passes)", value=s.num_steps)
        yield CounterMetricFamily("specfleet_spec_draft_tokens", "Draft tokens sent to the target",
                                  value=s.num_drafted)
        yield CounterMetricFamily("specfleet_spec_accepted_tokens", "Draft tokens the target kept",
                                  value=s.num_accepted)
        yield CounterMetricFamily("specfleet_spec_emitted_tokens", "Tokens emitted by the engine", value=s.num_emitted)
        yield gauge("specfleet_spec_acceptance_rate", "accepted / drafted", s.acceptance_rate)
        yield gauge("specfleet_spec_per_token_acceptance", "accepted / judged: the chance the target keeps a drafted "
                    "token whose prefix it kept (tokens after a rejection are not judged)", s.per_token_acceptance)
        yield gauge("specfleet_spec_mean_accepted_length", "(accepted + steps) / steps: tokens per target pass",
                    s.mean_accepted_length)
        per_step = s.num_drafted / s.num_steps if s.num_steps else 0.0
        yield gauge("specfleet_spec_draft_tokens_per_step", "Observed speculation length (drafted / steps)",
                    per_step)
        if snap.num_speculative_tokens is not None:
            yield gauge("specfleet_spec_length", "Current speculation length (an adaptive controller's choice, "
                        "else the configured one)", snap.num_speculative_tokens)
        by_pos = GaugeMetricFamily("specfleet_spec_acceptance_by_position",
                                   "Fraction of steps whose accepted path reached this depth", labels=["position"])
        for k, rate in enumerate(s.acceptance_by_position, start=1):
            by_pos.add_metric([str(k)], rate)
        yield by_pos
        used = CounterMetricFamily("specfleet_spec_draft_steps", "Steps whose draft came from this source",
                                   labels=["draft"])
        for name, count in sorted(s.drafts_used.items()):
            used.add_metric([name], count)
        yield used
        weights = GaugeMetricFamily("specfleet_draft_weight", "Vote or selection weight of a draft source",
                                    labels=["draft"])
        for name, w in sorted(snap.draft_weights.items()):
            if isinstance(w, (int, float)):
                weights.add_metric([name], float(w))
        yield weights
        acc = GaugeMetricFamily("specfleet_draft_acceptance_rate", "Acceptance rate of one draft source",
                                labels=["draft"])
        for name, stats in sorted(snap.draft_stats.items()):
            rate = _acceptance_rate(stats)
            if rate is not None:
                acc.add_metric([name], rate)
        yield acc


def _acceptance_rate(stats: object) -> float | None:
    """A composite proposer's `draft_stats[name]`: a SpecStats, or a mapping with "drafted"/"accepted"."""
    if isinstance(stats, SpecStats):
        return stats.acceptance_rate if stats.num_drafted else None
    if isinstance(stats, Mapping) and stats.get("drafted"):
        return float(stats.get("accepted", 0)) / float(stats["drafted"])
    return None
