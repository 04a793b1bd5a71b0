"""Benchmark arithmetic: pure functions over per-request and per-wave timings.

Conventions (speculative ones follow specfleet/core/stats.py):
- a *wave* is one batch of `batch_size` prompts submitted together; its wall time runs from submit
  to the last request's end. Aggregate throughput = all output tokens / sum of wave wall times.
- per-request tokens/s = output tokens / latency, where latency runs from submission to the
  request's last token; normalized latency = latency / output tokens (the seeds' metric, s/token).
- decode throughput leaves the prefill out: sum over waves of (output tokens - tokens out at the first
  token time) divided by sum over waves of (wall - the wave's last first-token time). The prefill
  emits one token per request; transformers' assisted generation verifies a draft in its first pass,
  so there the tokens out at that time are counted as they are.
- a step is one target pass that verified a draft (possibly empty); mean accepted length =
  (accepted + steps) / steps, counting the bonus token (plain decoding scores 1); acceptance rate =
  accepted / drafted; goodput = emitted tokens / time spent drafting and verifying.
- speed-up = a system's figure / the baseline system's figure at the same batch size, same run.
- roofline: decoding reads every target weight once per target pass, so one sequence cannot beat
  bandwidth / weight bytes tokens per second without speculation; a batch of B shares the read, so
  the bound for B concurrent sequences is B times that. Speculation can exceed it (several tokens
  per read): a fraction above 1 is the point of speculating.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass
class RequestRecord:
    system: str
    batch_size: int
    prompt_id: str
    prompt_tokens: int
    output_tokens: int
    latency_s: float
    ttft_s: float | None = None
    # speculative counters; None where the system cannot tell (see the module docstring)
    steps: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    draft_time_s: float | None = None
    verify_time_s: float | None = None
    accepted_at_depth: list[int] | None = None  # [k] = steps whose accepted path reached depth k+1
    judged: int | None = None  # draft positions the target judged: accepted ones and first rejections (core/stats.py)
    matches_baseline: bool | None = None  # output ids equal the baseline system's for this prompt
    strategy_overhead_s: float | None = None  # voting, weight updates, fitting, matching (its wave's share)
    cached_tokens: int | None = None  # prompt tokens the system's prefix cache served (None: it cannot tell)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.latency_s if self.latency_s > 0 else 0.0

    @property
    def normalized_latency_s(self) -> float:
        return self.latency_s / self.output_tokens if self.output_tokens else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "tok_s": round(self.tok_s, 4),
                "normalized_latency_s": round(self.normalized_latency_s, 6)}


@dataclass
class WaveRecord:
    system: str
    batch_size: int
    num_requests: int
    output_tokens: int
    wall_s: float
    first_token_s: float | None  # when the wave's last request got its first token (end of prefill)
    num_first_tokens: int | None = None  # tokens out by then; default one per request


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _sum_known(records: list[RequestRecord], field: str):
    vals = [getattr(r, field) for r in records if getattr(r, field) is not None]
    return sum(vals) if vals else None


def summarize(requests: list[RequestRecord], waves: list[WaveRecord]) -> dict:
    """The figures of one system at one batch size."""
    num_out = sum(r.output_tokens for r in requests)
    wall = sum(w.wall_s for w in waves)
    decode_tokens = sum(w.output_tokens - (w.num_first_tokens or w.num_requests) for w in waves)
    decode_wall = sum(w.wall_s - (w.first_token_s or 0.0) for w in waves)
    tok_s = [r.tok_s for r in requests]
    norm = [r.normalized_latency_s * 1e3 for r in requests if r.output_tokens]
    ttft = [r.ttft_s * 1e3 for r in requests if r.ttft_s is not None]
    out = {
        "num_requests": len(requests),
        "num_waves": len(waves),
        "mean_concurrency": len(requests) / len(waves) if waves else 0.0,
        "output_tokens": num_out,
        "wall_s": wall,
        "throughput_tok_s": num_out / wall if wall > 0 else 0.0,
        "decode_throughput_tok_s": decode_tokens / decode_wall if decode_wall > 0 else None,
        "request_tok_s_mean": statistics.fmean(tok_s) if tok_s else 0.0,
        "request_tok_s_p50": percentile(tok_s, 50),
        "normalized_latency_ms_mean": statistics.fmean(norm) if norm else None,
        "normalized_latency_ms_p50": percentile(norm, 50) if norm else None,
        "normalized_latency_ms_p90": percentile(norm, 90) if norm else None,
        "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
        "ttft_ms_p90": percentile(ttft, 90) if ttft else None,
        "cached_prompt_share": _cached_share(requests),
    }
    out.update(spec_summary(requests))
    matches = [r.matches_baseline for r in requests if r.matches_baseline is not None]
    out["baseline_match_rate"] = sum(matches) / len(matches) if matches else None
    return out


def _cached_share(requests: list[RequestRecord]) -> float | None:
    """Prompt tokens served by the prefix cache over all prompt tokens, for the requests that report it."""
    known = [r for r in requests if r.cached_tokens is not None]
    total = sum(r.prompt_tokens for r in known)
    return sum(r.cached_tokens for r in known) / total if total else None


def spec_summary(requests: list[RequestRecord]) -> dict:
    steps, drafted, accepted = (_sum_known(requests, f) for f in ("steps", "drafted", "accepted"))
    # over the requests that report what was judged (another system's records may count only accepted / drafted)
    judged = _sum_known(requests, "judged")
    accepted_of_judged = _sum_known([r for r in requests if r.judged is not None], "accepted")
    draft_t, verify_t = _sum_known(requests, "draft_time_s"), _sum_known(requests, "verify_time_s")
    overhead = _sum_known(requests, "strategy_overhead_s")
    emitted = sum(r.output_tokens for r in requests if r.steps is not None)
    spent = (draft_t or 0.0) + (verify_t or 0.0)
    depth: list[int] = []
    for r in requests:
        for k, c in enumerate(r.accepted_at_depth or []):
            depth.extend([0] * (k + 1 - len(depth)))
            depth[k] += c
    return {
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted and accepted is not None else None,
        "per_token_acceptance": accepted_of_judged / judged if judged and accepted_of_judged is not None else None,
        "mean_accepted_length": (accepted + steps) / steps if steps and accepted is not None else None,
        "acceptance_by_position": [c / steps for c in depth] if steps else [],
        "draft_time_s": draft_t,
        "verify_time_s": verify_t,
        "draft_time_share": draft_t / spent if draft_t is not None and spent > 0 else None,
        "goodput_tok_s": emitted / spent if steps is not None and spent > 0 else None,
        # the strategies' own decisions against the time the steps took (drafting + verification)
        "strategy_overhead_s": overhead,
        "strategy_overhead_share": overhead / spent if overhead is not None and spent > 0 else None,
    }


def add_speedups(summaries: list[dict], baseline: str | None) -> None:
    """Set speedup_* on every summary row (dicts with 'system' and 'batch_size') against `baseline`."""
    base = {s["batch_size"]: s for s in summaries if s["system"] == baseline}
    for s in summaries:
        b = base.get(s["batch_size"])
        s["speedup_throughput"] = ratio(s["throughput_tok_s"], b["throughput_tok_s"]) if b else None
        s["speedup_request_tok_s"] = ratio(s["request_tok_s_mean"], b["request_tok_s_mean"]) if b else None


def roofline_tok_s(bandwidth_bytes_s: float, weight_bytes_per_step: int) -> float:
    """Upper bound on one sequence's tokens/s for plain decoding: one full weight read per token."""
    return bandwidth_bytes_s / weight_bytes_per_step if weight_bytes_per_step > 0 else float("inf")


def add_roofline(summaries: list[dict], bound_tok_s: float | None) -> None:
    for s in summaries:
        bound = bound_tok_s * s["mean_concurrency"] if bound_tok_s else None
        s["roofline_tok_s"] = bound
        s["roofline_fraction"] = ratio(s["throughput_tok_s"], bound) if bound else None


def value_of(summaries: list[dict], system: tuple[str, int], metric: str) -> float | None:
    """metric of (system, batch size) among the summaries, or None where it is missing."""
    return next((s.get(metric) for s in summaries if (s["system"], s["batch_size"]) == tuple(system)), None)


def ratio_check(summaries: list[dict], a: tuple[str, int], b: tuple[str, int], metric: str) -> float | None:
    """metric(system a at batch a) / metric(system b at batch b), or None if either is missing."""
    return ratio(value_of(summaries, a, metric), value_of(summaries, b, metric))


def ratio(x, y) -> float | None:
    """x / y, or None where either is missing (or y is 0)."""
    return x / y if x is not None and y else None
