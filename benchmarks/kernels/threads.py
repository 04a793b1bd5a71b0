"""OpenMP waiting for specfleet's native runtime, idle and beside a co-running process (issue 29, item 5).

Each setting runs `benchmarks/peers/native_peer.py --child` (decode tg64, prefill pp128, c(k) of the native model) in
its own process with only that variable changed: libgomp's default (spin 300,000 rounds, then sleep),
`OMP_WAIT_POLICY=passive` (sleep at once) and `GOMP_SPINCOUNT=10000` (a short spin: specfleet's default,
set in specfleet/__init__.py). Each runs idle and
then beside a busy Python loop (another process wanting one of the two cores, as on a shared machine),
in alternating order over rounds; llama-bench's tg64 beside the same co-runner is the peer's figure.

    .venv/bin/python benchmarks/kernels/threads.py --llama-bench <build>/bin/llama-bench --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# "default" is libgomp's own (300,000 spins, its documented default); specfleet sets 10,000 unless told otherwise
SETTINGS = {"default": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "passive"},
            "spin10k": {"GOMP_SPINCOUNT": "10000"}}
PEER = Path(__file__).resolve().parents[1] / "peers" / "native_peer.py"


def child(model: str, env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))} | env_extra
    proc = subprocess.run([sys.executable, str(PEER), "--child", "--model", model, "--repeats", "2"], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen-1.5b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-bench", default=None)
    args = ap.parse_args()
    from specfleet.bench.llamacpp import gguf_path
    from specfleet.bench.report import md_table, write_results

    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for load in ("idle", "co-runner"):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "co-runner" else None
            try:
                names = list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]
                for name in names:
                    res = child(args.model, SETTINGS[name])
                    runs.setdefault(f"{name} {load}", []).append(res)
                    print(f"round {r} {load:9s} {name:8s} tg {res['tg_tok_s']:6.2f}  pp {res['pp_tok_s']:7.2f}  "
                          f"c(2) {res['c(2)']:.2f}  c(4) {res['c(4)']:.2f}", flush=True)
                if args.llama_bench:
                    out = subprocess.run([args.llama_bench, "-m", str(gguf_path(args.model)), "-p", "0", "-n", "64",
                                          "-r", "2", "-o", "json"], capture_output=True, text=True, check=True)
                    tg = json.loads(out.stdout)[0]["avg_ts"]
                    runs.setdefault(f"llama.cpp {load}", []).append({"tg_tok_s": tg})
                    print(f"round {r} {load:9s} llama.cpp tg {tg:6.2f}", flush=True)
            finally:
                if hog:
                    hog.kill()
    rows = [{"setting": k, **{f: statistics.median(x[f] for x in v) for f in ("tg_tok_s", "pp_tok_s", "c(2)", "c(4)")
                              if f in v[0]}} for k, v in runs.items()]
    print(md_table(rows, ["setting", "tg_tok_s", "pp_tok_s", "c(2)", "c(4)"]))
    body = (f"{args.model}, native runtime, each setting in its own process, medians over {args.rounds} rounds; "
            "'co-runner': a busy Python loop in another process for the whole setting. OMP/GOMP variables other "
            "than the setting's are removed for every run; llama.cpp (llama-bench tg64) with its defaults.\n\n"
            + md_table(rows, ["setting", "tg_tok_s", "pp_tok_s", "c(2)", "c(4)"]))
    print(write_results("threads", {"args": vars(args), "runs": runs, "summary": rows}, body, device="cpu",
                        dtype="gguf"))


if __name__ == "__main__":
    main()
