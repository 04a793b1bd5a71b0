"""Issue 44's probe: can one client's requests slow another's stream, or grow the server for good?

    flock /tmp/specfleet-bench.lock .venv/bin/python tools/probe_isolation.py --port 18400   # ~3 min

Starts `specfleet serve smollm2-135m-instruct` on 127.0.0.1 (loopback only), lets a steady streaming
request decode alone (its longest and 99th-percentile inter-token gaps: the idle values), then runs it
again while a hostile client sends, one after another:
  - a completion with a 900,000-id stop_token_ids list and n=64 (1.8 MB body);
  - a completion constrained by a 1.3 MB regex (a literal of random letters; over the server's bound on a
    constraint's text; with --regex-at-bound also one by a 60 KB regex, under it: it compiles);
  - 8 completions with 2 MB prompts at once (the server runs with a 3 MB body limit so they get in);
  - 40 completions, each with a distinct 190 KB JSON schema.
It reports each attack's status and time, the steady stream's gaps under attack against idle (and which
attacks were in flight during the longest ones), and the server's RSS (from /proc) at the start (after a
warm-up stream and one constrained request, which builds the grammar engine's one-time view of the
tokenizer) and after the attacks. Every loop is bounded by a count and a
deadline; every request has a timeout. The verdicts: the longest gap under attack < 2x idle, and the
RSS back within 10 % of its start.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from specfleet.bench.startup import wait_healthy

MODEL = "smollm2-135m-instruct"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def start_server(port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specfleet.server", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--draft", "none", "--max-model-len", "8192", "--max-body-bytes", str(3 << 20),
           "--no-access-log", "--log-level", "warning"]
    f = log.open("w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    wait_healthy(proc, f"http://127.0.0.1:{port}", 240, lambda: log.read_text()[-2000:], poll_s=0.5)
    return proc


def steady_stream(base: str, max_tokens: int, stop_at: threading.Event | None = None) -> list[float]:
    """Arrival times of a streamed completion's chunks (one token each at this server's pace)."""
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times: list[float] = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
            if stop_at is not None and stop_at.is_set():
                break
    return times


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times[1:], times[2:])]  # from the second chunk: the first is the prefill


def timed_gaps(times: list[float]) -> list[tuple[float, float]]:
    """(when the gap ended, the gap) from the second chunk on."""
    return [(b, b - a) for a, b in zip(times[1:], times[2:])]


def attack_bodies(regex_at_bound: bool = False) -> list[tuple[str, bytes]]:
    """Every hostile body, serialized before the attack starts (the client's own CPU time is not the
    server's): (name, JSON bytes)."""
    def raw(body: dict) -> bytes:
        return json.dumps(body, separators=(",", ":")).encode()

    letters = random.Random(0).choices("abcdefghij", k=1_300_000)  # over the bound on a regex: refused (a 400)
    bodies = [("stop_token_ids 900k, n=64", raw({"prompt": "Hi", "max_tokens": 8, "n": 64, "temperature": 1,
                                                 "stop_token_ids": [7] * 900_000})),
              ("regex 1.3 MB", raw({"prompt": "Say a word:", "max_tokens": 4, "temperature": 0,
                                    "structured_outputs": {"regex": "".join(letters)}}))]
    if regex_at_bound:  # just under the server's bound on a regex's text: it compiles (off the engine thread),
        # and its per-token masks, computed on the engine thread, are the dearest a client can ask for
        bodies.append(("regex 60 KB", raw({"prompt": "Say a word:", "max_tokens": 4, "temperature": 0,
                                           "structured_outputs": {"regex": "".join(letters[:60_000])}})))
    prompt = ("lorem ipsum " * 180_000)[:2_000_000]
    bodies += [(f"prompt 2 MB #{i}", raw({"prompt": prompt, "max_tokens": 1})) for i in range(8)]
    for i in range(40):
        schema = {"type": "object", "properties": {f"k{i}_{j}": {"type": "string", "description": "x" * 3700}
                                                   for j in range(50)}}
        bodies.append((f"schema 190 KB #{i}", raw({"prompt": "JSON:", "max_tokens": 2, "temperature": 0,
                                                   "structured_outputs": {"json": schema}})))
    return bodies


def attack(base: str, bodies: list[tuple[str, bytes]], results: list[dict]) -> None:
    """The bodies in order; the 8 large prompts at once, the rest one after another."""
    client = httpx.Client(timeout=180)

    def send(name: str, raw: bytes) -> None:
        t0 = time.monotonic()
        try:
            r = client.post(base + "/v1/completions", content=raw, headers={"content-type": "application/json"})
            status, message = r.status_code, (r.json().get("error") or {}).get("message", "")[:160]
        except httpx.HTTPError as e:
            status, message = None, f"{type(e).__name__}: {e}"[:160]
        t1 = time.monotonic()
        results.append({"attack": name, "status": status, "seconds": round(t1 - t0, 3),
                        "body_bytes": len(raw), "message": message, "t0": t0, "t1": t1})

    at_once = [b for b in bodies if b[0].startswith("prompt 2 MB")]
    for name, raw in bodies:
        if name == at_once[0][0]:
            threads = [threading.Thread(target=send, args=b) for b in at_once]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
        elif not name.startswith("prompt 2 MB"):
            send(name, raw)
    client.close()


def ttft(base: str, prompt: str) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.monotonic() - t0
    raise RuntimeError("no token came")


def ttft_behind_long_prefill(base: str, long_words: int, shorts: int) -> dict:
    """Issue 44, item 15: a short request's time to first token alone, and while a long prompt (about
    `long_words` tokens) is being prefilled."""
    short = "Hi there, how"
    idle = [ttft(base, short) for _ in range(shorts)]
    words = " ".join(f"w{i % 997}" for i in range(long_words))
    counted = httpx.post(base + "/tokenize", json={"prompt": words}, timeout=60).json()["count"]
    long_prompt = words[: int(len(words) * long_words / max(1, counted))]  # about long_words tokens
    long_result: dict = {}

    def hold() -> None:
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", timeout=300, json={"prompt": long_prompt, "max_tokens": 1,
                                                                    "temperature": 0})
        long_result.update(status=r.status_code, seconds=time.monotonic() - t0,
                           prompt_tokens=(r.json().get("usage") or {}).get("prompt_tokens"))

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    time.sleep(0.1)
    busy = []
    for _ in range(shorts):
        if not holder.is_alive():
            break
        busy.append(ttft(base, short))
    holder.join(300)
    return {"short_ttft_idle_s": idle, "short_ttft_behind_long_s": busy, "long": long_result}


def attack_process(base: str, bodies: list[tuple[str, bytes]], channel) -> None:
    results: list[dict] = []
    attack(base, bodies, results)
    channel.put(results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--idle-tokens", type=int, default=120, help="tokens per steady stream (one after another)")
    ap.add_argument("--idle-rounds", type=int, default=4, help="steady streams measured before the attack")
    ap.add_argument("--long-tokens", type=int, default=4400, help="the long prompt of the TTFT phase (0: skip)")
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds the attack phase may take in all")
    ap.add_argument("--regex-at-bound", action="store_true",
                    help="also send a 60 KB regex, just under the server's bound (it compiles and is served)")
    args = ap.parse_args()
    from specfleet.bench.report import md_table, result_path, run_metadata, write_folder

    base = f"http://127.0.0.1:{args.port}"
    log = Path(f"/tmp/probe_isolation-{args.port}.log")
    proc = start_server(args.port, log)
    try:
        steady_stream(base, 16)  # warm-up: the first stream, and the grammar engine's one-time view of the
        # tokenizer (built by the first constrained request; a server that has served one holds it)
        httpx.post(base + "/v1/completions", json={"prompt": "Yes or no?", "max_tokens": 2,
                                                   "structured_outputs": {"choice": ["yes", "no"]}}, timeout=120)
        time.sleep(2)
        rss_start = rss_bytes(proc.pid)
        idle: list[float] = []
        for _ in range(args.idle_rounds):  # about as many gaps as under attack: a max over as many samples
            idle += gaps(steady_stream(base, args.idle_tokens))
        results: list[dict] = []
        # the hostile client is a process of its own: its threads must not hold up (through this process's
        # GIL) the reader whose timestamps are the measurement
        ctx = multiprocessing.get_context("fork")
        channel = ctx.Queue()
        attacker = ctx.Process(target=attack_process, args=(base, attack_bodies(args.regex_at_bound), channel), daemon=True)
        busy: list[float] = []
        busy_at: list[tuple[float, float]] = []
        t0 = time.monotonic()
        attacker.start()
        rounds = 0
        while attacker.is_alive() and time.monotonic() - t0 < args.deadline and rounds < 200:
            got = timed_gaps(steady_stream(base, args.idle_tokens))
            busy += [g for _, g in got]
            busy_at += got
            rounds += 1
        attacker.join(max(1.0, args.deadline - (time.monotonic() - t0)))
        finished = not attacker.is_alive()
        if finished:
            results = channel.get(timeout=30)
        else:
            attacker.kill()
        time.sleep(3)
        rss_end = rss_bytes(proc.pid)
        prefill = ttft_behind_long_prefill(base, args.long_tokens, 3) if args.long_tokens else None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    idle_max, busy_max = max(idle), max(busy) if busy else float("nan")
    # the longest gaps under attack, each with the attacks that were in flight while it lasted
    worst = []
    for end, g in sorted(busy_at, key=lambda x: -x[1])[:5]:
        during = [r["attack"] for r in results if r["t0"] < end and r["t1"] > end - g]
        worst.append({"gap_s": round(g, 3), "attacks_in_flight": during[:4] + (["..."] if len(during) > 4 else [])})
    p99 = lambda xs: statistics.quantiles(xs, n=100)[98] if len(xs) >= 100 else max(xs)  # noqa: E731
    payload = {
        "model": MODEL, "server_args": "--dtype float32 --draft none --max-model-len 8192 --max-body-bytes 3145728",
        "idle_gaps": len(idle), "idle_gap_max_s": idle_max, "idle_gap_p50_s": statistics.median(idle), "idle_gap_p99_s": p99(idle),
        "attack_gap_max_s": busy_max, "attack_gap_p50_s": statistics.median(busy) if busy else None,
        "attack_gap_p99_s": p99(busy) if busy else None, "attack_tokens": len(busy), "stream_rounds": rounds,
        "gap_ratio": busy_max / idle_max, "gap_ok": busy_max < 2 * idle_max,
        "rss_start_bytes": rss_start, "rss_end_bytes": rss_end, "rss_change": rss_end / rss_start - 1,
        "rss_ok": abs(rss_end / rss_start - 1) <= 0.10, "attacks_finished": finished, "attacks": results,
        "worst_gaps": worst, "ttft": prefill,
    }
    rows = [{"what": r["attack"], "status": r["status"], "s": r["seconds"], "bytes": r["body_bytes"],
             "message": r["message"][:90]} for r in results if not re.search(r"#([1-9]|[1-3][0-9])$", r["attack"])]
    body = (f"Steady stream (SmolLM2-135M fp32, no draft): longest inter-token gap idle {idle_max:.3f} s "
            f"(p50 {payload['idle_gap_p50_s']:.3f}, p99 {payload['idle_gap_p99_s']:.3f}) over {len(idle)} gaps; under attack "
            f"{busy_max:.3f} s (p50 {payload['attack_gap_p50_s']:.3f}, p99 {payload['attack_gap_p99_s']:.3f}) over "
            f"{len(busy)} gaps: **{payload['gap_ratio']:.2f}x** idle ({'under' if payload['gap_ok'] else 'NOT under'} 2x).\n\n"
            f"Server RSS: {rss_start / 2**20:.0f} MiB at the start, {rss_end / 2**20:.0f} MiB after the attacks "
            f"(**{payload['rss_change'] * 100:+.1f} %**, {'within' if payload['rss_ok'] else 'NOT within'} 10 %).\n\n"
            f"Attacks (first of each kind; all {len(results)} in results.json; finished: {finished}):\n\n"
            + md_table(rows, ["what", "status", "s", "bytes", "message"])
            + "\n\nLongest gaps under attack and what was in flight:\n\n"
            + md_table([{"gap s": w["gap_s"], "in flight": ", ".join(w["attacks_in_flight"]) or "-"} for w in worst],
                       ["gap s", "in flight"]))
    if prefill is not None:
        lr = prefill["long"]
        body += (f"\n\nA 4-token request's time to first token: idle {', '.join(f'{x:.3f}' for x in prefill['short_ttft_idle_s'])} s; "
                 f"while a {lr.get('prompt_tokens')}-token prompt is prefilled (status {lr.get('status')}, "
                 f"{lr.get('seconds', 0):.2f} s to its one token): "
                 f"{', '.join(f'{x:.3f}' for x in prefill['short_ttft_behind_long_s']) or 'none measured'} s.")
    meta = run_metadata("isolation", dtype="float32")
    out_dir = result_path(meta)
    json_path, _ = write_folder(out_dir, meta, payload, body)
    print(body)
    print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
