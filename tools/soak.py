"""Soak test: many clients against one real server for minutes, then: did anything leak or die?

The server runs in a child process on 127.0.0.1 (loopback only) with the real model and a draft source
that raises now and then (`--fail-rate`: the chance that one propose call raises). Concurrent clients
(`--clients`) pick, request after request:

    stream      a streamed chat or completion, read to its end
    disconnect  a stream the client drops after a few chunks (the server must abort and free it)
    slow        a stream read slowly (a pause between chunks)
    abandon     a non-streamed request whose client gives up before the answer (it disconnects)
    chat        a multi-turn conversation: each turn resends the whole conversation so far, as chat
                clients do, and appends the answer (a new conversation after --turns turns)
    canary      one fixed greedy completion, again and again: every answer must be the same, whether or
                not a draft failure sent it to plain decoding

Bounded in time (`--minutes`) and count (`--max-requests`). The checks, each a line of the report:

- the server's resident memory (RSS, from /proc) after warm-up (the first `--warmup` fraction of the
  run) grows by less than `--max-rss-growth` (5 %): median of the last tenth of the samples against
  the median of the tenth right after warm-up;
- every KV block is free at the end: /metrics `specfleet_kv_blocks_held` (blocks held by live requests,
  async_engine.num_held_blocks) and `specfleet_engine_requests` are 0 once the clients are done;
- zero engine deaths: /health answered 200 at every sample and at the end, and the server never logged
  "engine step failed";
- every response complete (a finish_reason and [DONE]) or a clear error (an OpenAI error body with a
  message), except the disconnects the clients made on purpose;
- the raising proposer's requests were served by plain decoding: draft failures happened (/metrics),
  every response whose `spec.draft_failures` > 0 is complete, and all canary answers are equal.

    python tools/soak.py --minutes 10            # the full form; writes benchmarks/results/soak-cpu-*.json/.md
    python tools/soak.py --minutes 1 --no-write  # a smoke test

Exits 1 when a check fails. tests/tools/test_soak.py runs a short form (about 30 s of load) in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "smollm2-135m-instruct"
CANARY_PROMPT = "The three primary colors are"
CANARY_TOKENS = 24
USER_TURNS = ["Name a fruit.", "Why do you like it?", "Tell me one more fact about it.", "Say that in French.",
              "Now summarise our conversation.", "Give it a title.", "Count the words in that title.",
              "Write a haiku about it."]
STREAM_PROMPTS = ["Write a short story about a robot.", "List three colors.", "def fibonacci(n):",
                  "Explain what a KV cache is.", "The capital of France is", "Once upon a time"]
SCENARIOS = {"stream": 3, "disconnect": 2, "slow": 2, "abandon": 1, "chat": 3, "canary": 2}


# -- the server (child process) --------------------------------------------------------------------
class RaisingProposer:
    """Wraps the engine's draft source; each propose call raises with probability `rate` (seeded)."""

    def __init__(self, inner, rate: float, seed: int):
        self._inner, self._rate, self._rng = inner, rate, random.Random(seed)
        self.name = getattr(inner, "name", "draft")

    def propose(self, requests):
        if self._rng.random() < self._rate:
            raise RuntimeError("soak: injected draft failure")
        return self._inner.propose(requests)

    def observe(self, feedback):
        return self._inner.observe(feedback)

    def release(self, request_id):
        return self._inner.release(request_id)

    def __getattr__(self, name):  # optional capabilities (weights, speculation length) pass through
        return getattr(self._inner, name)


def serve_child(argv: list[str]) -> int:
    from specfleet.cli.serve import add_serve_args, run_serve

    parser = argparse.ArgumentParser(prog="soak.py --serve")
    add_serve_args(parser)
    parser.add_argument("--fail-rate", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def prepare(llm) -> None:
        if llm.engine.proposer is None:
            raise SystemExit("the soak server needs a draft (--draft) for its raising proposer")
        llm.engine.proposer = RaisingProposer(llm.engine.proposer, args.fail_rate, args.seed)

    return run_serve(args, prepare)


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


def start_server(args) -> Server:
    log = Path(tempfile.mkstemp(prefix="specfleet-soak-", suffix=".log")[1])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--model", args.model, "--draft", args.draft,
           "--spec-len", str(args.spec_len), "--max-model-len", str(args.max_model_len), "--kv-cache-mb",
           str(args.kv_cache_mb), "--max-num-seqs", str(args.max_num_seqs), "--host", "127.0.0.1", "--port", "0",
           "--no-access-log", "--log-level", "warning", "--fail-rate", str(args.fail_rate), "--seed", str(args.seed),
           "--served-model-name", "soak"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    from specfleet.bench.startup import logged_url, wait_healthy

    return Server(proc, wait_healthy(proc, logged_url(log), 300, lambda: log.read_text()[-3000:]), log)


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait()


# -- the clients -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    scenario: str
    status: str  # complete | disconnected | error | unclear
    detail: str = ""
    draft_failures: int = 0
    text: str | None = None
    seconds: float = 0.0


@dataclass
class Run:
    args: argparse.Namespace
    url: str
    deadline: float
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None  # when the last client finished
    num_started: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    def more(self) -> bool:
        return time.monotonic() < self.deadline and self.num_started < self.args.max_requests


def error_outcome(scenario: str, status_code: int, body: str) -> Outcome:
    """A non-200 answer: a clear error has an OpenAI error body with a message."""
    try:
        err = json.loads(body)["error"]
        if err.get("message"):
            return Outcome(scenario, "error", f"{status_code} {err.get('code') or err.get('type')}")
    except (ValueError, KeyError, TypeError):
        pass
    return Outcome(scenario, "unclear", f"{status_code} without an error body: {body[:200]!r}")


async def stream_request(client, run: Run, scenario: str, path: str, body: dict, stop_after: int | None = None,
                         pause_s: float = 0.0) -> Outcome:
    """A streamed request; `stop_after` chunks: disconnect then; `pause_s`: a slow reader."""
    import httpx

    chunks, text, finish, failures, done = 0, [], None, 0, False
    try:
        async with client.stream("POST", run.url + path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return error_outcome(scenario, r.status_code, (await r.aread()).decode(errors="replace"))
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    err = event["error"]
                    kind = "error" if err.get("message") else "unclear"
                    return Outcome(scenario, kind, f"in-stream {err.get('code') or err.get('type')}")
                for choice in event.get("choices", []):
                    piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    text.append(piece or "")
                    finish = choice.get("finish_reason") or finish
                failures = max(failures, (event.get("spec") or {}).get("draft_failures", 0))
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    return Outcome(scenario, "disconnected", f"after {chunks} chunks")
                if pause_s:
                    await asyncio.sleep(pause_s)
    except httpx.HTTPError as e:
        return Outcome(scenario, "unclear", f"transport error: {e!r}")
    if done and finish in ("stop", "length"):
        return Outcome(scenario, "complete", finish, failures, "".join(text))
    return Outcome(scenario, "unclear", f"stream ended without a finish ({finish}) or [DONE] ({done})")


async def plain_request(client, run: Run, scenario: str, path: str, body: dict, timeout_s: float | None = None
                        ) -> tuple[Outcome, dict | None]:
    import httpx

    try:
        r = await client.post(run.url + path, json=body, timeout=timeout_s or run.args.request_timeout)
    except httpx.TimeoutException:
        if timeout_s is not None:
            return Outcome(scenario, "disconnected", "gave up waiting"), None
        return Outcome(scenario, "unclear", "no answer within the request timeout"), None
    except httpx.HTTPError as e:
        return Outcome(scenario, "unclear", f"transport error: {e!r}"), None
    if r.status_code != 200:
        return error_outcome(scenario, r.status_code, r.text), None
    got = r.json()
    choice = got["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    failures = (got.get("spec") or {}).get("draft_failures", 0)
    if choice.get("finish_reason") not in ("stop", "length"):
        return Outcome(scenario, "unclear", f"finish_reason {choice.get('finish_reason')!r}"), got
    return Outcome(scenario, "complete", choice["finish_reason"], failures, text), got


async def client_loop(client, run: Run, rng: random.Random) -> None:
    a = run.args
    conversation: list[dict] = []
    names, weights = list(SCENARIOS), list(SCENARIOS.values())
    while run.more():
        run.num_started += 1
        scenario = rng.choices(names, weights)[0]
        t0 = time.monotonic()
        prompt = rng.choice(STREAM_PROMPTS)
        tokens = rng.randint(8, a.max_tokens)
        if scenario in ("stream", "disconnect", "slow"):
            as_chat = rng.random() < 0.5
            path = "/v1/chat/completions" if as_chat else "/v1/completions"
            body = {"model": "soak", "max_tokens": tokens, "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 99)}
            body.update({"messages": [{"role": "user", "content": prompt}]} if as_chat else {"prompt": prompt})
            out = await stream_request(client, run, scenario, path, body,
                                       stop_after=rng.randint(1, 4) if scenario == "disconnect" else None,
                                       pause_s=rng.uniform(0.05, 0.25) if scenario == "slow" else 0.0)
        elif scenario == "abandon":
            out, _ = await plain_request(client, run, scenario, "/v1/completions",
                                         {"model": "soak", "prompt": prompt, "max_tokens": a.max_tokens,
                                          "ignore_eos": True}, timeout_s=rng.uniform(0.05, 0.5))
        elif scenario == "canary":
            out, _ = await plain_request(client, run, scenario, "/v1/completions",
                                         {"model": "soak", "prompt": CANARY_PROMPT, "max_tokens": CANARY_TOKENS,
                                          "temperature": 0, "ignore_eos": True})
        else:  # chat: resend the whole conversation, append the answer
            if len(conversation) >= 2 * a.turns:
                conversation = []
            conversation.append({"role": "user", "content": USER_TURNS[len(conversation) // 2 % len(USER_TURNS)]})
            body = {"model": "soak", "messages": conversation, "max_tokens": tokens, "temperature": 0}
            if rng.random() < 0.5:
                out = await stream_request(client, run, scenario, "/v1/chat/completions", body)
            else:
                out, _ = await plain_request(client, run, scenario, "/v1/chat/completions", body)
            if out.status == "complete":
                conversation.append({"role": "assistant", "content": out.text or ""})
            else:
                conversation = []
        out.seconds = time.monotonic() - t0
        if scenario != "canary":
            out.text = None  # only canaries are compared; the rest would only grow this process
        run.outcomes.append(out)


async def sample_loop(server: Server, run: Run, samples: list[dict], stop: asyncio.Event, every_s: float) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            samples.append(await sample(server, client, run))
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass


async def sample(server: Server, client, run: Run) -> dict:
    health = (await client.get(server.url + "/health")).status_code
    return {"t": round(time.monotonic() - run.started, 2), "rss": server.rss_bytes(), "health": health,
            **await metrics(client, server.url)}


METRICS = {"specfleet_kv_blocks_held": "held_blocks", "specfleet_kv_blocks_free": "free_blocks",
           "specfleet_kv_blocks_total": "blocks", "specfleet_engine_requests": "engine_requests",
           "specfleet_requests_running": "running", "specfleet_requests_waiting": "waiting",
           "specfleet_engine_healthy": "healthy", "specfleet_engine_step_failures_total": "step_failures",
           "specfleet_spec_draft_failures_total": "draft_failures",
           "specfleet_spec_draft_fallback_requests_total": "fallback_requests",
           "specfleet_stalled_streams_total": "stalled_streams", "specfleet_spec_accepted_tokens_total": "accepted",
           "specfleet_generation_tokens_total": "generated_tokens"}


async def metrics(client, url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(url + "/metrics")).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in METRICS and not s.labels:
                out[METRICS[s.name]] = s.value
    return out


async def drive(server: Server, args) -> tuple[Run, list[dict], dict]:
    import httpx

    run = Run(args, server.url, time.monotonic() + 60 * args.minutes)
    samples: list[dict] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_loop(server, run, samples, stop, args.sample_every))
    limits = httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.clients)]
        await asyncio.gather(*(client_loop(client, run, rng) for rng in rngs))
    run.ended = time.monotonic()
    stop.set()
    await sampler
    # idle: every request ended, every block free (abandoned requests are aborted within a step)
    async with httpx.AsyncClient(timeout=10) as client:
        deadline = time.monotonic() + 30
        while True:
            end = await sample(server, client, run)
            if (end.get("held_blocks"), end.get("engine_requests")) == (0, 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    return run, samples, end


# -- checks and report ---------------------------------------------------------------------------
def evaluate(args, run: Run, samples: list[dict], end: dict, log_text: str, exit_code: int | None) -> dict:
    load = [s for s in samples if s["t"] <= run_seconds(run)]
    warm = [s for s in load if s["t"] >= args.warmup * run_seconds(run)]
    tenth = max(1, len(warm) // 10)
    rss_after_warmup = statistics.median(s["rss"] for s in warm[:tenth]) if warm else float("nan")
    rss_end = statistics.median(s["rss"] for s in warm[-tenth:]) if warm else float("nan")
    growth = (rss_end - rss_after_warmup) / rss_after_warmup if warm else float("nan")
    by_status: dict[str, int] = {}
    by_scenario: dict[str, dict[str, int]] = {}
    for o in run.outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
        counts = by_scenario.setdefault(o.scenario, {})
        counts[o.status] = counts.get(o.status, 0) + 1
    unclear = [f"{o.scenario}: {o.detail}" for o in run.outcomes if o.status == "unclear"]
    errors: dict[str, int] = {}
    for o in run.outcomes:
        if o.status == "error":
            errors[o.detail] = errors.get(o.detail, 0) + 1
    canaries = [o for o in run.outcomes if o.scenario == "canary" and o.status == "complete"]
    canary_texts = {o.text for o in canaries}
    hit = [o for o in run.outcomes if o.draft_failures > 0]
    deaths = "engine step failed" in log_text or any(s["health"] != 200 for s in samples) or end["health"] != 200
    checks = {
        "rss_growth_after_warmup_below_limit": bool(growth < args.max_rss_growth),
        "no_kv_blocks_held_at_end": end.get("held_blocks") == 0 and end.get("engine_requests") == 0
        and end.get("free_blocks") == end.get("blocks"),
        "no_engine_deaths": not deaths and end.get("step_failures", 0) == 0,
        "every_response_complete_or_clear_error": not unclear,
        "draft_failures_happened": end.get("draft_failures", 0) > 0 and end.get("fallback_requests", 0) > 0,
        "failed_draft_requests_served_by_plain_decoding": all(o.status == "complete" for o in hit) and len(hit) > 0,
        "canary_answers_all_equal": len(canaries) >= 2 and len(canary_texts) == 1,
        "server_exit_clean": exit_code == 0,
    }
    return {
        "checks": checks, "passed": all(checks.values()),
        "settings": {k: v for k, v in vars(args).items() if k not in ("serve",)},
        "run_seconds": round(run_seconds(run), 1), "requests": len(run.outcomes), "by_status": by_status,
        "by_scenario": by_scenario, "errors": errors, "unclear": unclear[:20],
        "rss_mib": {"after_warmup": round(rss_after_warmup / 2**20, 1), "end_of_load": round(rss_end / 2**20, 1),
                    "max": round(max(s["rss"] for s in samples) / 2**20, 1) if samples else None,
                    "idle_end": round(end["rss"] / 2**20, 1), "growth": round(growth, 4)},
        "end_metrics": end, "responses_hit_by_draft_failures": len(hit),
        "canaries": {"complete": len(canaries), "distinct_answers": len(canary_texts)},
        "samples": [{k: s.get(k) for k in ("t", "rss", "health", "held_blocks", "running", "waiting",
                                           "draft_failures", "generated_tokens")} for s in samples],
    }


def run_seconds(run: Run) -> float:
    return (run.ended or time.monotonic()) - run.started


def markdown(result: dict) -> str:
    from specfleet.bench.report import md_table

    lines = ["## Checks", "", md_table([{"check": k, "result": "pass" if v else "FAIL"}
                                        for k, v in result["checks"].items()], ["check", "result"]), ""]
    r = result["rss_mib"]
    lines += [f"- {result['requests']} requests in {result['run_seconds']} s; outcomes {result['by_status']}",
              f"- server RSS (MiB): after warm-up {r['after_warmup']}, end of load {r['end_of_load']} "
              f"(growth {100 * r['growth']:.2f} %), max {r['max']}, idle at the end {r['idle_end']}",
              f"- draft failures {result['end_metrics'].get('draft_failures')}, requests sent to plain decoding "
              f"{result['end_metrics'].get('fallback_requests')}, responses hit {result['responses_hit_by_draft_failures']}",
              f"- canaries: {result['canaries']}; clear errors: {result['errors'] or 'none'}", "",
              "## Outcomes by scenario", "",
              md_table([{"scenario": k, **v} for k, v in result["by_scenario"].items()],
                       ["scenario", "complete", "disconnected", "error", "unclear"])]
    if result["unclear"]:
        lines += ["", "## Unclear outcomes (first 20)", "", *[f"- {u}" for u in result["unclear"]]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long clients send requests")
    p.add_argument("--max-requests", type=int, default=100_000, help="stop sending after this many")
    p.add_argument("--clients", type=int, default=12, help="concurrent clients")
    p.add_argument("--max-tokens", type=int, default=48, help="most tokens a request asks for")
    p.add_argument("--turns", type=int, default=6, help="turns of a conversation before a new one")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--draft", default="prompt-lookup")
    p.add_argument("--spec-len", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=int, default=128)
    p.add_argument("--fail-rate", type=float, default=0.02, help="chance that one propose call raises")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before RSS is watched")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS and /metrics samples")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--no-write", action="store_true", help="print the report; write nothing under benchmarks/results")
    return p.parse_args(argv)


def soak(args: argparse.Namespace) -> dict:
    server = start_server(args)
    try:
        run, samples, end = asyncio.run(drive(server, args))
    finally:
        code = stop_server(server)
    log_text = server.log.read_text(errors="replace")
    result = evaluate(args, run, samples, end, log_text, code)
    result["server_log_tail"] = log_text.splitlines()[-30:]
    server.log.unlink(missing_ok=True)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve_child(argv[1:])
    args = parse_args(argv)
    result = soak(args)
    body = markdown(result)
    print(body)
    if not args.no_write:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from specfleet.bench.report import write_results

        path = write_results("soak", result, body, device="cpu", dtype="gguf blocks")
        print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
