"""OpenAI-compatible servers side by side on one GGUF file: `specfleet serve` and llama.cpp's `llama-server`.

Each system is a server in its own process with its own default threading (nothing is set for the peer:
no OMP_WAIT_POLICY, no thread count), started, driven and stopped in turn, in alternating order over
`--rounds`. Every system gets the same raw HumanEval prompts on `/v1/completions`, greedy, streamed,
`--max-tokens` each, at each concurrency in `--concurrency` (a client pool of that many streams over all
prompts); then the same prompts once more at concurrency 1, which shows what a server keeps of earlier
prompts (prefix caching) in its time to first token.

Figures per system and concurrency: aggregate completion tok/s (all tokens over the wall time of the
pool), median time to first token, and the repeated prompts' median TTFT. Ratios against the first
llama-server system are printed side by side. Systems:

    specfleet            specfleet serve, its default draft
    specfleet-plain      specfleet serve --draft none
    llama-server         llama-server (plain decoding)
    llama-server-ngram   llama-server --spec-type ngram-mod (llama.cpp's own weightless speculation)

    python benchmarks/peers/servers.py --llama-server /path/to/llama-server --prompts 16 --concurrency 1 8

`--llama-server` is a native build (`cmake -DGGML_NATIVE=ON`, see ../shared/PERFORMANCE.md). Writes
benchmarks/results/servers-cpu-<time>/results.json and report.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from specfleet.bench.startup import wait_healthy

SYSTEMS = ("specfleet", "specfleet-plain", "llama-server", "llama-server-ngram")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(system: str, gguf: Path, model_name: str, port: int, llama_server: str | None, slots: int,
            llama_args: tuple[str, ...] = ()) -> list[str]:
    if system.startswith("specfleet"):
        cmd = [str(Path(sys.executable).with_name("specfleet")), "serve", "--model", model_name, "--port", str(port),
               "--max-num-seqs", str(max(slots, 8))]
        return cmd + (["--draft", "none"] if system == "specfleet-plain" else [])
    if llama_server is None:
        raise SystemExit(f"{system} needs --llama-server PATH (a native build of llama.cpp)")
    # slots for the concurrent streams, each with room for a prompt and its answer; threads left at llama.cpp's default
    cmd = [llama_server, "-m", str(gguf), "--port", str(port), "-np", str(slots), "-c", str(2048 * slots), *llama_args]
    return cmd + (["--spec-type", "ngram-mod"] if system == "llama-server-ngram" else [])


def start(cmd: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = cmd[cmd.index("--port") + 1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}  # each system's own default threading
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = wait_healthy(proc, f"http://127.0.0.1:{port}", 900, lambda: log.read_text()[-3000:], poll_s=1)
    return proc, url


def model_id(url: str) -> str:
    """The name the server serves its model under (specfleet answers 404 for another name, as OpenAI does)."""
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def one_request(url: str, prompt: str, max_tokens: int, model: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, chunks, usage = None, [], 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(choice["text"])
                    chunks += 1
    end = time.perf_counter() - t0
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft_s": ttft if ttft is not None else end, "latency_s": end, "tokens": tokens, "text": "".join(text),
            "start": t0, "end": t0 + end}


def run_pool(url: str, prompts: list[str], concurrency: int, max_tokens: int, model: str) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(url, p, max_tokens, model), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "wall_s": round(wall, 3), "tokens": tokens,
            "aggregate_tok_s": round(tokens / wall, 2),
            "median_ttft_s": round(statistics.median(r["ttft_s"] for r in results), 3),
            "texts": [r["text"] for r in results]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen-1.5b")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--systems", nargs="+", default=["llama-server", "specfleet", "specfleet-plain"], choices=SYSTEMS)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--dataset", default="humaneval", help="prompt set of specfleet.bench.datasets (humaneval, sharegpt, ...)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--llama-args", default="", help="extra llama-server options, only where its defaults fail on "
                    "this CPU (e.g. '--no-repack' where its AMX path crashes); recorded with the command")
    ap.add_argument("--repeat", action=argparse.BooleanOptionalAction, default=True,
                    help="send the prompts once more, one at a time (time to first token of cached prompts)")
    args = ap.parse_args()

    from specfleet.bench.datasets import iter_prompts, select
    from specfleet.bench.llamacpp import gguf_path
    from specfleet.bench.report import md_table, result_path, run_metadata, write_folder

    gguf = gguf_path(args.model)
    source, _ = iter_prompts(args.dataset)
    prompts = [p.text for p in select(source, args.prompts)]
    logdir = Path(tempfile.mkdtemp(prefix="bench-servers-"))
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    slots = max(args.concurrency)
    for rnd in range(args.rounds):
        order = args.systems if rnd % 2 == 0 else list(reversed(args.systems))
        for system in order:
            cmd = command(system, gguf, args.model, free_port(), args.llama_server, slots, tuple(shlex.split(args.llama_args)))
            proc, url = start(cmd, logdir / f"{system}-{rnd}.log")
            try:
                model = model_id(url)
                one_request(url, prompts[0][:200], 4, model)  # warm-up (first forward, kernel build), not timed
                entry = {"round": rnd, "command": " ".join(cmd), "pools": []}
                for c in args.concurrency:
                    pool = run_pool(url, prompts, c, args.max_tokens, model)
                    entry["pools"].append(pool)
                    print(f"round {rnd} {system:20s} c={c:2d}: {pool['aggregate_tok_s']:7.2f} tok/s aggregate, "
                          f"median TTFT {pool['median_ttft_s']:.2f} s", flush=True)
                if args.repeat:
                    repeat = run_pool(url, prompts, 1, args.max_tokens, model)
                    entry["repeat"] = repeat
                    print(f"round {rnd} {system:20s} repeated prompts: median TTFT {repeat['median_ttft_s']:.2f} s",
                          flush=True)
                runs[system].append(entry)
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    ref = next((s for s in args.systems if s.startswith("llama-server")), args.systems[0])
    rows = []
    for c_i, c in enumerate(args.concurrency):
        ref_tok = statistics.median(e["pools"][c_i]["aggregate_tok_s"] for e in runs[ref])
        for system in args.systems:
            tok = statistics.median(e["pools"][c_i]["aggregate_tok_s"] for e in runs[system])
            rows.append({"concurrency": c, "system": system, "aggregate tok/s": tok,
                         f"x {ref}": round(tok / ref_tok, 3) if ref_tok else None,
                         "median TTFT s": statistics.median(e["pools"][c_i]["median_ttft_s"] for e in runs[system]),
                         "repeat TTFT s": statistics.median(e["repeat"]["median_ttft_s"] for e in runs[system])
                         if args.repeat else None})
    print(md_table(rows, list(rows[0])))
    base_texts = runs[args.systems[0]][0]["pools"][0]["texts"]
    same = {s: sum(a == b for a, b in zip(base_texts, runs[s][0]["pools"][0]["texts"])) for s in args.systems}
    meta = run_metadata("servers", dtype="gguf")
    payload = {"model": args.model, "gguf": str(gguf), "dataset": args.dataset, "prompts": args.prompts,
               "max_tokens": args.max_tokens,
               "rounds": args.rounds, "runs": runs, "summary": rows, "outputs_equal_to_first_system": same,
               "threads": "each server's own default (no OMP_* variables passed to either)"}
    body = (f"Servers in their own processes, default threading, {args.prompts} {args.dataset} prompts, greedy, "
            f"{args.max_tokens} tokens, streamed on /v1/completions; medians over {args.rounds} round(s) in "
            f"alternating order. 'repeat TTFT': the same prompts again, one at a time.\n\n"
            + md_table(rows, list(rows[0]))
            + f"\n\nOutputs equal to {args.systems[0]}'s (of {args.prompts}, concurrency {args.concurrency[0]}): "
            + ", ".join(f"{s} {n}" for s, n in same.items()) + "\n\nCommands:\n\n"
            + "\n".join(f"- {s}: `{runs[s][0]['command']}`" for s in args.systems) + "\n")
    json_path, _ = write_folder(result_path(meta), meta, payload, body)
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
