"""A bounded load test: 32 concurrent streaming clients against the real server, every request answered,
no KV block leaked (checked through /metrics), p50/p99 latency and throughput printed.

Sizes can be raised for a manual run: SPECFLEET_LOAD_CLIENTS, SPECFLEET_LOAD_REQUESTS.
"""
from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass

import openai
import pytest

from tests.server.harness import MODEL, start_server, stop_server

pytestmark = pytest.mark.real_model

NUM_CLIENTS = int(os.environ.get("SPECFLEET_LOAD_CLIENTS", "32"))
NUM_REQUESTS = int(os.environ.get("SPECFLEET_LOAD_REQUESTS", "192"))
TIME_LIMIT_S = 240.0
TOPICS = ["cats", "rivers", "the moon", "bread", "trains", "music", "winter", "bees", "stars", "tea"]


@dataclass
class Result:
    latency_s: float
    ttft_s: float
    num_tokens: int
    finish_reason: str


@pytest.fixture(scope="module")
def server():
    # 32 running sequences in a deliberately small KV cache, so the scheduler also preempts under load
    srv = start_server("--kv-cache-mb", "40", "--max-num-seqs", str(NUM_CLIENTS), "--max-queue", "64")
    yield srv
    stop_server(srv)


async def one_request(client: openai.AsyncOpenAI, rng: random.Random) -> Result:
    topic = rng.choice(TOPICS)
    max_tokens = rng.randint(2, 8)
    t0 = time.perf_counter()
    ttft, text, last, finish_reason = None, "", None, None
    usage = {"include_usage": True}
    if rng.random() < 0.5:
        stream = await client.completions.create(model=MODEL, prompt=f"A short note about {topic}:",
                                                 max_tokens=max_tokens, temperature=rng.choice([0, 0.7]),
                                                 stream=True, stream_options=usage)
        async for chunk in stream:
            if chunk.choices:
                ttft = ttft or time.perf_counter() - t0
                text += chunk.choices[0].text
                finish_reason = chunk.choices[0].finish_reason or finish_reason
            last = chunk
    else:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"One sentence about {topic}."}],
            max_tokens=max_tokens, temperature=rng.choice([0, 0.7]), stream=True, stream_options=usage)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
            if chunk.choices:
                finish_reason = chunk.choices[0].finish_reason or finish_reason
            last = chunk
    assert last is not None and last.usage is not None, "the last chunk carries usage"
    assert 1 <= last.usage.completion_tokens <= max_tokens
    return Result(time.perf_counter() - t0, ttft or 0.0, last.usage.completion_tokens, finish_reason)


async def run_load(base_url: str) -> tuple[list[Result], float]:
    pending = iter(range(NUM_REQUESTS))
    results: list[Result] = []

    async def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
            for _ in pending:  # the clients share one iterator: NUM_REQUESTS in all
                results.append(await one_request(client, rng))

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(client_loop(i) for i in range(NUM_CLIENTS))), TIME_LIMIT_S)
    return results, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def test_concurrent_streaming_clients_all_answered_no_leak(server):
    before = server.metrics()
    results, wall_s = asyncio.run(run_load(server.url("/v1")))
    assert len(results) == NUM_REQUESTS
    assert all(r.finish_reason in ("stop", "length") for r in results)

    after = server.wait_idle()  # nothing running or waiting, every KV block free again
    served = sum(v for k, v in after.items() if k.startswith("specfleet_requests_total{"))
    served -= sum(v for k, v in before.items() if k.startswith("specfleet_requests_total{"))
    assert served == NUM_REQUESTS
    tokens = sum(r.num_tokens for r in results)
    assert after["specfleet_generation_tokens_total"] - before.get("specfleet_generation_tokens_total", 0) == tokens

    lat = [r.latency_s for r in results]
    ttft = [r.ttft_s for r in results]
    print(f"\nload: {NUM_REQUESTS} requests from {NUM_CLIENTS} concurrent streaming clients in {wall_s:.1f}s: "
          f"{NUM_REQUESTS / wall_s:.2f} req/s, {tokens / wall_s:.1f} output tok/s; "
          f"latency p50 {pct(lat, 50):.2f}s p99 {pct(lat, 99):.2f}s; ttft p50 {pct(ttft, 50):.2f}s "
          f"p99 {pct(ttft, 99):.2f}s; mean accepted length {after['specfleet_spec_mean_accepted_length']:.2f}")
