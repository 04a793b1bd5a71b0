"""specfleet's native GGUF runtime against llama.cpp at its best, side by side on one file: decode, prefill
and the verification cost c(k), for each of specfleet's kernel ISA paths the CPU runs.

The peer is a native llama.cpp build (`cmake -DGGML_NATIVE=ON`, ../shared/PERFORMANCE.md) run as its own
`llama-bench` process with its default threading: no thread count, wait policy or other setting is
imposed on it. specfleet runs in its own process per system too (`SPECFLEET_ISA=<path>`, the thread
count torch picks), so neither inherits the other's OpenMP state. Rounds alternate the systems' order;
medians over rounds and per-round ratios are printed.

Figures, per system:
- `tg_tok_s`: decode tok/s, llama-bench's tg64 (64 tokens from an empty context, or after `--depth` tokens:
  its `-d`); specfleet: the same, 64 one-token forwards of its runner (the engine's path: batch building,
  every layer, the output head), after a prefill of `--depth` tokens that is not timed.
- `pp_tok_s`: prefill tok/s of a 128-token prompt from an empty cache (llama-bench's pp128).
- `c(k)`, k = 1..8 (specfleet): the forward over k+1 new tokens with every row's logits after 128 cached
  tokens, in one-token forwards at the same context (bench/gguf_micro.py `verify_costs`).

    .venv/bin/python benchmarks/peers/native_peer.py --llama-bench /path/to/build/bin/llama-bench \\
        --model qwen-1.5b --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TG, PP = 64, 128


def specfleet_child(model: str, repeats: int, depth: int = 0) -> dict:
    """One specfleet system, measured in this process (run as a child with SPECFLEET_ISA set)."""
    import torch

    from specfleet.bench.gguf_micro import verify_costs
    from specfleet.llm import LLM
    from specfleet.runtime.backends.native import kernels as native_backend
    from specfleet.runtime.step.runner import ForwardItem

    llm = LLM(model, draft="none", quantization="auto")
    engine = llm.engine
    ids = [(7919 * i) % 30000 + 100 for i in range(PP + TG + depth + 16)]

    def run(new_ids, start, rows):
        engine.runner.execute([ForwardItem("b", new_ids, start, rows)], engine.blocks)

    tg, pp = [], []
    for _ in range(repeats):
        engine.blocks.allocate("b", PP + TG)
        try:
            t0 = time.perf_counter()
            run(ids[:PP], 0, [PP - 1])
            pp.append(PP / (time.perf_counter() - t0))
        finally:
            engine.blocks.free("b")
        engine.blocks.allocate("b", depth + TG)
        try:
            t0 = time.perf_counter()
            if depth:
                run(ids[:depth], 0, [depth - 1])
                t0 = time.perf_counter()
            for i in range(depth, depth + TG):
                run([ids[i]], i, [0])
            tg.append(TG / (time.perf_counter() - t0))
        finally:
            engine.blocks.free("b")
    one, costs = verify_costs(engine, [ids], repeats)
    return {"tg_tok_s": max(tg), "pp_tok_s": max(pp), "decode_step_ms_at_128": one * 1e3,
            **{f"c({k})": c for k, c in enumerate(costs, 1)},
            "kernel_isa": native_backend.isa(), "threads": torch.get_num_threads()}


def run_specfleet(path: str, model: str, repeats: int, depth: int = 0) -> dict:
    env = dict(os.environ, SPECFLEET_ISA=path)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--model", model,
                           "--repeats", str(repeats), "--depth", str(depth)], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"specfleet ({path}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_llama_bench(binary: str, gguf: str, repeats: int, depth: int = 0) -> dict:
    """llama-bench as a user runs it: its own process, its default threads and options; JSON out. Decode
    and prefill run as two processes, so that where one of llama.cpp's default paths crashes on this CPU
    (its AMX matmul segfaulted on prompts on a Sapphire Rapids VM here) the other still counts; the failed
    test is rerun with `--repack 0` (no repacked or AMX weight buffers) and that is recorded."""
    out: dict = {"notes": []}
    tg = ["-p", "0", "-n", str(TG)] + (["-d", str(depth)] if depth else [])
    for key, args in (("tg_tok_s", tg), ("pp_tok_s", ["-p", str(PP), "-n", "0"])):
        for extra in ([], ["--repack", "0"]):
            proc = subprocess.run([binary, "-m", gguf, *args, "-r", str(repeats), "-o", "json", *extra],
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                break
            out["notes"].append(f"{key}: llama-bench {' '.join(args + extra)} exited with {proc.returncode}")
        else:
            raise SystemExit(f"llama-bench failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout)[0]
        out[key] = r["avg_ts"]
        out[key.replace("tok_s", "options")] = " ".join(extra) or "defaults"
        out.update(threads=r.get("n_threads"), cpu_info=r.get("cpu_info"), build_commit=r.get("build_commit"),
                   backends=r.get("backends"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="a native build's llama-bench")
    ap.add_argument("--model", default="qwen-1.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="repeats inside each system's run (best counts)")
    ap.add_argument("--isa", nargs="+", default=None, help="specfleet kernel paths (default: every one the CPU runs)")
    ap.add_argument("--depth", type=int, default=0, help="tokens of context before the timed decode (llama-bench -d)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(specfleet_child(args.model, args.repeats, args.depth)))
        return

    from specfleet.bench.llamacpp import gguf_path
    from specfleet.bench.report import md_table, write_results
    from specfleet.runtime.backends.native import kernels as native_backend

    gguf = str(gguf_path(args.model))
    paths = args.isa or native_backend.runnable_isas()
    systems = [f"specfleet {p}" for p in paths] + (["llama.cpp"] if args.llama_bench else [])
    per_round: list[dict] = []
    for r in range(args.rounds):
        res = {}
        for name in (systems if r % 2 == 0 else systems[::-1]):
            res[name] = (run_llama_bench(args.llama_bench, gguf, args.repeats, args.depth) if name == "llama.cpp"
                         else run_specfleet(name.split()[1], args.model, args.repeats, args.depth))
            print(f"round {r} {name:22s} tg {res[name]['tg_tok_s']:6.2f} tok/s  pp {res[name]['pp_tok_s']:7.2f} tok/s"
                  + "".join(f"  c({k}) {res[name][f'c({k})']:.2f}" for k in (1, 2, 4, 8) if f"c({k})" in res[name]),
                  flush=True)
        per_round.append(res)
    ref = "llama.cpp" if args.llama_bench else systems[-1]
    table = []
    for name in systems:
        row = {"system": name}
        for key in ["tg_tok_s", "pp_tok_s"] + [f"c({k})" for k in range(1, 9)]:
            vals = [rd[name][key] for rd in per_round if key in rd[name]]
            if vals:
                row[key] = statistics.median(vals)
        for key in ("tg_tok_s", "pp_tok_s"):
            row[f"{key[:2]}_vs_{ref.split()[-1]}"] = statistics.median(rd[name][key] / rd[ref][key] for rd in per_round)
        row["threads"] = per_round[-1][name].get("threads")
        table.append(row)
        print(f"{name:22s} tg {row['tg_tok_s']:6.2f} ({row['tg_vs_' + ref.split()[-1]]:.2f}x)  "
              f"pp {row['pp_tok_s']:7.2f} ({row['pp_vs_' + ref.split()[-1]]:.2f}x)"
              + "".join(f"  c({k}) {row[f'c({k})']:.2f}" for k in range(1, 9) if f"c({k})" in row))
    cols = ["system", "tg_tok_s", f"tg_vs_{ref.split()[-1]}", "pp_tok_s", f"pp_vs_{ref.split()[-1]}",
            *[f"c({k})" for k in range(1, 9)], "threads"]
    peer = per_round[-1].get("llama.cpp", {})
    body = (f"{args.model} ({gguf}), {args.rounds} rounds alternating order, medians over rounds; ratios are "
            f"medians of per-round ratios against {ref}. llama.cpp: `{args.llama_bench}` (a native build, commit "
            f"{peer.get('build_commit')}, backends {peer.get('backends')}) as its own process with its default "
            f"threading ({peer.get('threads')} threads), tg{TG} ({peer.get('tg_options')}) / pp{PP} "
            f"({peer.get('pp_options')}){'; ' + '; '.join(peer['notes']) if peer.get('notes') else ''}. "
            "specfleet: each kernel ISA path in its own "
            f"process, decode = {TG} one-token forwards after {args.depth} cached tokens (their prefill untimed), prefill = one {PP}-token forward, "
            "c(k) = a (k+1)-row forward with every row's logits after 128 cached tokens over a one-row forward. "
            "OMP_WAIT_POLICY and OMP_NUM_THREADS unset for every system unless the header says otherwise.\n\n"
            + md_table(table, cols))
    print(write_results("native-peer", {"args": vars(args), "gguf": gguf, "rounds": per_round, "summary": table},
                        body, device="cpu", dtype="gguf"))


if __name__ == "__main__":
    main()
