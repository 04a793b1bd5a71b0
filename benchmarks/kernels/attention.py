"""The native attention (csrc/q_fused.c `specfleet_attend`) per ISA path, at the embedded 1.5B's shape.

    python benchmarks/kernels/attention.py [--isa avx2 avx512vnni] [--lengths 128 512 2048] [--rows 1 5] [--threads 1 2]
    python benchmarks/kernels/attention.py --base-src /tmp/base --lengths 512 2048 4096 --rows 1 3 5 9 13 --threads 2

One call is what one decoder layer's attention costs in a step: `rows` query rows of one request (1: a
decode step; 5: a k=4 chain verification), row i seeing the context's L keys plus the new rows up to
itself, 12 query heads over 2 KV heads of 128 (Qwen2.5-Coder-1.5B), fp32 keys and values as the KV cache
holds them. Best of `--repeats` timings of `--calls` calls each; microseconds per call and the step's
share (x 28 layers) are printed side by side for the paths, and written under benchmarks/results/.

`--base-src DIR` (another source tree, e.g. `git archive <commit> | tar -x -C DIR`) instead builds DIR's kernels for
the first `--isa` path beside this tree's and times the two alternately, as a step meets attention: each
measurement is 28 calls, one per layer, each over its own keys and values (so they come from memory, not from
the cache the previous call warmed); the median of `--repeats` measurements per tree, and the outputs must be
equal bit for bit."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specfleet.bench.report import md_table, write_results
from specfleet.runtime.backends.native import kernels as native_backend
from specfleet.runtime.model.attention import AttentionBatch, SeqAttention
from specfleet.runtime.step.plan import KeyPlan, native_attend

H, KVH, D, LAYERS = 12, 2, 128, 28


def time_call(lib, length: int, rows: int, threads: int, calls: int, repeats: int) -> float:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(length)
    k = torch.randn(length + rows, KVH, D, generator=g)
    v = torch.randn(length + rows, KVH, D, generator=g)
    q = torch.randn(rows, H, D, generator=g)
    batch = AttentionBatch(torch.zeros(rows, dtype=torch.long), [SeqAttention(rows, length, slice(0, length + rows))])
    want = native_attend(lib, q, k, v, batch, D ** -0.5)
    # the C call alone, as a step's layers make it (the key plan is built once per step, not per layer)
    args, out = KeyPlan.build(batch).c_args(), torch.empty_like(q)
    call = lambda: lib.specfleet_attend(q.data_ptr(), rows, H, KVH, D, k.data_ptr(), v.data_ptr(), KVH * D,
                                        *args, D ** -0.5, out.data_ptr(), threads)
    assert call() == 0 and torch.equal(out, want)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def base_library(src: Path, path: str):
    """The native library of source tree `src` for ISA path `path`, built with this tree's flags."""
    return native_backend.build(path, src / "specfleet" / "runtime" / "backends" / "native" / "csrc")


def ab_rows(base, this, length: int, rows: int, threads: int, repeats: int) -> dict:
    """Median seconds of a step's 28 layers of attention, each layer its own keys, base and this tree alternating."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(length + rows)
    ks = [torch.randn(length + rows, KVH, D, generator=g) for _ in range(LAYERS)]
    vs = [torch.randn(length + rows, KVH, D, generator=g) for _ in range(LAYERS)]
    q = torch.randn(rows, H, D, generator=g)
    batch = AttentionBatch(torch.zeros(rows, dtype=torch.long), [SeqAttention(rows, length, slice(0, length + rows))])
    args = KeyPlan.build(batch).c_args()
    times: dict[str, list[float]] = {"base": [], "this": []}
    outs = {}
    for r in range(repeats):
        for name, lib in (("base", base), ("this", this)) if r % 2 == 0 else (("this", this), ("base", base)):
            out = torch.empty_like(q)
            t0 = time.perf_counter()
            for layer in range(LAYERS):
                lib.specfleet_attend(q.data_ptr(), rows, H, KVH, D, ks[layer].data_ptr(), vs[layer].data_ptr(),
                                     KVH * D, *args, D ** -0.5, out.data_ptr(), threads)
            times[name].append(time.perf_counter() - t0)
            outs[name] = out
    assert torch.equal(outs["base"], outs["this"]), "the two trees' attention differs"
    b, t = statistics.median(times["base"]) * 1e3, statistics.median(times["this"]) * 1e3
    return {"keys": length, "rows": rows, "threads": threads, "base ms/step": round(b, 2), "this ms/step": round(t, 2),
            "this / base": round(t / b, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", nargs="+", default=native_backend.runnable_isas())
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 2048])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 5])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--base-src", type=Path, default=None, help="A/B against this source tree's kernels (see above)")
    args = ap.parse_args()
    if args.base_src is not None:
        path = args.isa[0]
        base, this = base_library(args.base_src, path), native_backend.library(path)
        rows = [ab_rows(base, this, n, r, th, max(args.repeats, 7)) for n in args.lengths for r in args.rows
                for th in args.threads]
        for row in rows:
            print(row, flush=True)
        body = (f"Native attention ({path}) of this tree against {args.base_src} at the 1.5B's shape ({H} query heads, "
                f"{KVH} KV heads of {D}): a step's {LAYERS} layers, each over its own keys and values, the two trees "
                f"alternating; medians of {max(args.repeats, 7)}. Outputs equal bit for bit.\n\n" + md_table(rows, list(rows[0])))
        print(write_results("attention-ab", {"rows": rows, "path": path, "base_src": str(args.base_src)}, body,
                            dtype="float32"))
        return
    libs = {p: native_backend.library(p) for p in args.isa if p in native_backend.runnable_isas()}
    rows = []
    for length in args.lengths:
        for n in args.rows:
            for th in args.threads:
                row = {"keys": length, "rows": n, "threads": th}
                for p, lib in libs.items():
                    row[f"{p} us"] = round(time_call(lib, length, n, th, args.calls, args.repeats), 1)
                    row[f"{p} ms/step"] = round(row[f"{p} us"] * LAYERS / 1000, 2)
                base = next(iter(libs))
                for p in list(libs)[1:]:
                    row[f"{p} speed-up"] = round(row[f"{base} us"] / row[f"{p} us"], 2)
                rows.append(row)
                print(row, flush=True)
    cols = list(rows[0])
    body = (f"Native attention at the 1.5B's shape ({H} query heads, {KVH} KV heads of {D}), one call = one layer's "
            f"attention in a step (x {LAYERS} layers = ms/step); best of {args.repeats} x {args.calls} calls.\n\n"
            + md_table(rows, cols))
    print(write_results("attention", {"rows": rows, "paths": list(libs)}, body, dtype="float32"))


if __name__ == "__main__":
    main()
