"""Which router to put in front of specfleet replicas: start time, memory and added latency.

One `specfleet serve` replica (one thread) is started; then each router command in turn is started in
front of it with the cache_aware policy, and the script measures the seconds from its start until a
request through it succeeds, its resident memory (with its children), and the median latency of
`--requests` one-token completions through it against the same requests sent to the replica directly
(measured before and after the routers, so drift shows).

    flock /tmp/specfleet-bench.lock python benchmarks/serving/routers.py \
        --router "smg 1.13.0=.venv/bin/smg launch" --router "sglang-router 0.3.2=/path/to/venv/bin/smg launch"

Each router command gets `--host 127.0.0.1 --port P --worker-urls URL --policy cache_aware
--prometheus-host 127.0.0.1 --prometheus-port Q` appended (the SGLang gateway's flags; vLLM's fork takes
the same). Writes benchmarks/results/routers-cpu-<time>/results.json and report.md.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from servers import free_port, start  # one way to start a server and wait for it (benchmarks/peers/servers.py)

from specfleet.bench.report import md_table, result_path, run_metadata, write_folder


def latency_ms(url: str, model: str, n: int) -> float:
    body = {"model": model, "prompt": "Hello there, how", "max_tokens": 1, "temperature": 0}
    times = []
    with httpx.Client(timeout=60) as c:
        for i in range(n + 3):
            t0 = time.perf_counter()
            c.post(url + "/v1/completions", json=body).raise_for_status()
            if i >= 3:  # the first few warm the connection and the prefix cache
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def rss_mb(pid: int) -> float:
    pids = [pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                    text=True).stdout.split()]
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += int(next(line for line in f if line.startswith("VmRSS")).split()[1])
        except (OSError, StopIteration):
            pass
    return total / 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router", action="append", required=True, metavar="NAME=COMMAND",
                   help="a router's name and command (flags are appended); repeat")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=40)
    args = p.parse_args(argv)

    meta = run_metadata("routers", dtype="gguf (model's own)")
    logs = Path(tempfile.mkdtemp(prefix="bench-routers-"))
    port = free_port()
    serve = [str(Path(sys.executable).with_name("specfleet")), "serve", "--model", args.model, "--port", str(port),
             "--draft", "suffix", "--no-access-log"]
    os.environ["OMP_NUM_THREADS"] = "1"
    replica, url = start(serve, logs / "replica.log")
    rows = []
    try:
        direct_before = latency_ms(url, args.model, args.requests)
        for spec in args.router:
            name, _, cmd = spec.partition("=")
            rport, mport = free_port(), free_port()
            argv_ = shlex.split(cmd) + ["--host", "127.0.0.1", "--port", str(rport), "--worker-urls", url,
                                        "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
                                        "--prometheus-port", str(mport)]
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv_, stdout=subprocess.DEVNULL, stderr=(logs / f"{rport}.log").open("w"))
            ready = None
            while time.perf_counter() - t0 < 120 and proc.poll() is None:
                try:
                    r = httpx.post(f"http://127.0.0.1:{rport}/v1/completions", timeout=10,
                                   json={"model": args.model, "prompt": "Hi", "max_tokens": 1})
                    if r.status_code == 200:
                        ready = time.perf_counter() - t0
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            row = {"router": name, "ready_s": ready}
            if ready is not None:
                row["rss_mb"] = rss_mb(proc.pid)
                row["routed_median_ms"] = latency_ms(f"http://127.0.0.1:{rport}", args.model, args.requests)
            else:
                row["error"] = (logs / f"{rport}.log").read_text()[-300:]
            proc.terminate()
            proc.wait(30)
            rows.append(row)
            print(row, flush=True)
        direct_after = latency_ms(url, args.model, args.requests)
    finally:
        replica.terminate()
        replica.wait(60)
    body = (f"One replica of {args.model} (suffix draft, 1 thread); {args.requests} one-token completions, median "
            f"latency direct: {direct_before:.1f} ms before the routers, {direct_after:.1f} ms after.\n\n"
            + md_table(rows, ["router", "ready_s", "rss_mb", "routed_median_ms"]) + "\n")
    json_path, _ = write_folder(result_path(meta), meta,
                                {"args": vars(args), "direct_before_ms": direct_before,
                                 "direct_after_ms": direct_after, "routers": rows}, body)
    print(body)
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
