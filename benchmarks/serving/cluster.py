"""Cache-aware routing against round-robin: multi-turn ShareGPT conversations over `specfleet cluster`.

Two replicas (one thread each on a 2-core machine) behind the SGLang Model Gateway; each arm starts a
fresh cluster (cold caches) with one router policy and replays the same conversations: real ShareGPT
conversations with at least `--turns` human turns, each turn sending the whole conversation so far (the
human turns and the model's own earlier answers, as a chat client does), `--concurrency` conversations
at a time, greedy, streamed. Per arm it reports, from the replicas' own /metrics: the prefix-cache hit
rate (tokens found cached / tokens looked up), the suffix draft's acceptance (accepted / drafted) and
tokens per target pass; from the client: time to first token of first turns and of later turns, and
the wall time. Arms (`--arm POLICY [SMG FLAGS]`, default cache_aware and round_robin) run in turn for
`--rounds` rounds.

    flock /tmp/specfleet-bench.lock python benchmarks/serving/cluster.py --conversations 12 --turns 4

Writes benchmarks/results/cluster-cpu-<time>/results.json and report.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specfleet.bench.datasets import DATASETS, data_file, iter_json_array
from specfleet.bench.report import md_table, result_path, run_metadata, write_folder
from specfleet.cluster.launcher import Cluster, ClusterConfig

COUNTERS = {
    "requests": r"^specfleet_requests_total\{[^}]*\} (\S+)$",
    "prefix_queried": r"^specfleet_prefix_cache_queried_tokens_total (\S+)$",
    "prefix_hit": r"^specfleet_prefix_cache_hit_tokens_total (\S+)$",
    "drafted": r"^specfleet_spec_draft_tokens_total (\S+)$",
    "accepted": r"^specfleet_spec_accepted_tokens_total (\S+)$",
    "spec_steps": r"^specfleet_spec_steps_total (\S+)$",
    "emitted": r"^specfleet_spec_emitted_tokens_total (\S+)$",
}


def conversations(num: int, turns: int, max_chars: int) -> list[list[str]]:
    """The first `num` ShareGPT conversations with at least `turns` non-empty human turns (each cut to
    `max_chars` characters), in file order."""
    out = []
    for record in iter_json_array(data_file(DATASETS["sharegpt"])):
        conv = record.get("conversations") if isinstance(record, dict) else None
        if not conv:
            continue
        human = [t.get("value", "").strip() for t in conv if t.get("from") == "human"]
        if len(human) >= turns and all(human[:turns]) and all(t.get("from") in ("human", "gpt") for t in conv):
            out.append([h[:max_chars] for h in human[:turns]])
            if len(out) == num:
                break
    if len(out) < num:
        raise SystemExit(f"only {len(out)} ShareGPT conversations have {turns} human turns")
    return out


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {k: sum(float(v) for v in re.findall(pat, text, re.M)) for k, pat in COUNTERS.items()}


async def one_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, parts = None, []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            delta = event["choices"][0].get("delta", {}).get("content") if event.get("choices") else None
            if delta:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(delta)
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "text": "".join(parts)}


async def replay(url: str, model: str, convs: list[list[str]], concurrency: int, max_tokens: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    records: list[dict] = []

    async def conversation(k: int, turns: list[str]) -> None:
        async with sem:
            messages: list[dict] = []
            for t, text in enumerate(turns):
                messages.append({"role": "user", "content": text})
                rec = await one_turn(client, url, model, messages, max_tokens)
                messages.append({"role": "assistant", "content": rec["text"]})
                records.append({"conversation": k, "turn": t, **rec})

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(conversation(k, c) for k, c in enumerate(convs)))
    return records


def free_port_run(first: int, n: int) -> int:
    for base in range(first, first + 100 - n):
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise SystemExit(f"no {n} consecutive free ports from {first}")


def run_arm(args: argparse.Namespace, arm: str, convs: list[list[str]], log_dir: Path) -> dict:
    """`arm`: a router policy, optionally with smg flags after it: "cache_aware --balance-abs-threshold=2"."""
    policy, *router_args = arm.split()
    config = ClusterConfig(replicas=args.replicas, threads_per_replica=args.threads_per_replica, policy=policy,
                           router_args=router_args,
                           serve_args=["--model", args.model, "--draft", args.draft, "--no-access-log"],
                           port=free_port_run(args.port, args.replicas + 2), log_dir=str(log_dir), restart=False)
    with Cluster(config) as cluster:
        urls = [r.url for r in cluster.replicas]
        before = [counters(u) for u in urls]
        t0 = time.perf_counter()
        records = asyncio.run(replay(cluster.url, args.model, convs, args.concurrency, args.max_tokens))
        wall = time.perf_counter() - t0
        after = [counters(u) for u in urls]
    delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before)]
    total = {k: sum(d[k] for d in delta) for k in COUNTERS}
    first = [r["ttft_s"] for r in records if r["turn"] == 0 and r["ttft_s"] is not None]
    later = [r["ttft_s"] for r in records if r["turn"] > 0 and r["ttft_s"] is not None]
    return {
        "policy": arm,
        "requests_per_replica": [d["requests"] for d in delta],
        "prefix_hit_rate": total["prefix_hit"] / total["prefix_queried"] if total["prefix_queried"] else 0.0,
        "prefix_hit_tokens": total["prefix_hit"], "prefix_queried_tokens": total["prefix_queried"],
        "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
        "drafted": total["drafted"], "accepted": total["accepted"],
        "tokens_per_pass": total["emitted"] / total["spec_steps"] if total["spec_steps"] else 0.0,
        "ttft_first_turn_median_s": statistics.median(first), "ttft_first_turn_mean_s": statistics.fmean(first),
        "ttft_later_turns_median_s": statistics.median(later), "ttft_later_turns_mean_s": statistics.fmean(later),
        "wall_s": wall, "turns": len(records),
        "answers": {f"{r['conversation']}/{r['turn']}": r["text"] for r in records},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft", default="suffix")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads-per-replica", type=int, default=1)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-chars", type=int, default=2000, help="each human turn cut to this many characters")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    p.add_argument("--rounds", type=int, default=1, help="rounds of all arms, in the order given")
    p.add_argument("--arm", action="append", default=None,
                   help="a router policy and optional smg flags, e.g. 'cache_aware --balance-abs-threshold=2'; "
                        "repeat (default: cache_aware, round_robin)")
    p.add_argument("--port", type=int, default=18640, help="first port to try (router, replicas, router metrics)")
    args = p.parse_args(argv)

    convs = conversations(args.conversations, args.turns, args.max_chars)
    meta = run_metadata("cluster", dtype="gguf (model's own)")
    out_dir = result_path(meta)
    arms = []
    for rnd in range(args.rounds):
        for k, policy in enumerate(args.arm or ["cache_aware", "round_robin"]):
            arm = run_arm(args, policy, convs, Path(tempfile.mkdtemp(prefix=f"bench-cluster-{rnd}-{k}-")))
            arm["round"] = rnd
            arms.append(arm)
            print(json.dumps({k: v for k, v in arm.items() if k != "answers"}), flush=True)
    ref = arms[0]["answers"]  # greedy and lossless: the same answers whichever replica served a turn
    same = [sum(a["answers"][k] == ref[k] for k in ref) for a in arms]
    rows = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in a.items() if k != "answers"} for a in arms]
    body = (f"{args.conversations} ShareGPT conversations x {args.turns} human turns (cut to {args.max_chars} chars), "
            f"{args.concurrency} at a time, max_tokens {args.max_tokens}, greedy; {args.replicas} replicas of "
            f"{args.model} (draft {args.draft}), {args.threads_per_replica} thread(s) each, behind smg.\n\n"
            + md_table(rows, ["round", "policy", "requests_per_replica", "prefix_hit_rate", "acceptance_rate",
                              "tokens_per_pass", "ttft_first_turn_median_s", "ttft_later_turns_median_s",
                              "ttft_later_turns_mean_s", "wall_s"])
            + f"\n\nAnswers identical to the first arm's, per arm: {same} of {len(convs) * args.turns}.\n")
    payload = {"args": vars(args), "arms": arms, "identical_answers_to_first_arm": same}
    json_path, md_path = write_folder(out_dir, meta, payload, body)
    print(body)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
