"""How the native GGUF block-format kernels (runtime/formats/qtensor.py, csrc/q_*.c) scale with the number of rows.

For each format, one decoder layer's four linear layers at the Qwen2.5-Coder-1.5B shapes (qkv, o,
gate_up, down; plus the 151936-row output head with --head) are kept in that format with random
valid blocks, and one forward through them is timed with 1..128 rows (tokens). Printed: the time, the
ratio to one row (what verifying k+1 drafted tokens costs in decode steps), GB/s of weights read at
one row and GFLOP/s at the largest row count. For comparison the same shapes run as bf16 through
torch's `F.linear` ("bf16 torch") and through the project's bf16 routes ("bf16 specfleet",
runtime/backends/cpu.py: the native bf16 kernel for few rows). Systems alternate within every repeat
and the best repeat counts, since the machine may be shared. On a shared machine run it with
OMP_WAIT_POLICY=passive as well: with libgomp's default spinning, a waiting OpenMP thread takes the
core the working one needs, and every 2-thread kernel here (torch's too) ran 3-10x slower.

    .venv/bin/python benchmarks/kernels/qkernels.py            # about a minute on 2 CPU cores
    .venv/bin/python benchmarks/kernels/qkernels.py --formats Q4_K Q6_K --rows 1 3 9 --head
    .venv/bin/python benchmarks/kernels/qkernels.py --threads 1 --clock thread   # one core's CPU time
    .venv/bin/python benchmarks/kernels/qkernels.py --formats Q4_K Q6_K --isa avx2 avx512vnni --no-bf16
    .venv/bin/python benchmarks/kernels/qkernels.py --gguf ~/.cache/specfleet/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

`--gguf FILE` times every matrix of a real file instead (its own mix of formats, the output head
included, the embedding left out): the linear layers' share of one decode step, and of verifying k+1
rows; it first checks a few rows of each format against gguf-py's dequantization.

`--clock thread` (with --threads 1) times the CPU the calling thread spent, which other processes on
a shared machine do not inflate: the steadiest per-core figures there.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from specfleet.bench.report import md_table, write_results
from specfleet.runtime.model import decoder as model_mod
from specfleet.runtime.backends.native import kernels as native_backend
from specfleet.runtime.formats import qtensor
from specfleet.runtime.formats.qtensor import QTensor, qlinear

# Qwen2.5-Coder-1.5B: hidden 1536, 12 q heads + 2 kv heads of 128, MLP 8960 (gate and up fused); [N, K]
SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
HEAD = {"head": (151936, 1536)}
FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]


def random_weight(qtype: T, n: int, k: int, rng: np.random.Generator) -> QTensor:
    """Random quants with small fp16 scales: the kernels' speed does not depend on the values."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    scale = np.full((n, k // block), 1e-3, np.float16).view(np.uint8).reshape(n, k // block, 2)
    for offset in ([size - 2] if qtype == T.Q6_K else [0, 2] if qtype in (T.Q4_1, T.Q4_K) else [0]):
        raw[:, :, offset:offset + 2] = scale
    return QTensor(raw.reshape(n, -1), qtype, (n, k))


def quant_fns(qtype: T, shapes: dict, rng, path: str | None = None) -> list:
    """One format's layers through the kernels of ISA path `path` (default: the one qlinear uses)."""
    ws = [random_weight(qtype, n, k, rng) for n, k in shapes.values()]
    lib = native_backend.library(path) if path else None
    if lib is not None:
        return [(lambda x, w=w: qtensor.run_qlinear(lib, x, w), w.shape[1], torch.float32, w.nbytes) for w in ws]
    return [(lambda x, w=w: qlinear(x, w), w.shape[1], torch.float32, w.nbytes) for w in ws]


def gguf_fns(path: str, isa: str | None = None) -> tuple[list, dict]:
    """Every supported matrix of the file but the embedding, as QTensors over its memory map, through the kernels
    of ISA path `isa` (default: the one qlinear uses); checks the kernel on 64 rows of the first matrix of each
    format against gguf-py's dequantization."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    fns, shapes, checked = [], {}, set()
    for t in GGUFReader(path).tensors:
        if len(t.shape) != 2 or t.tensor_type not in qtensor.SUPPORTED_TYPES or t.name == "token_embd.weight":
            continue
        w = QTensor(t.data, t.tensor_type, (int(t.shape[1]), int(t.shape[0])))
        if w.qtype not in checked:
            part, x = w.select_rows(slice(0, 64)), torch.randn(3, w.shape[1])
            ref = qtensor.quantize_activations(x, w.qtype).double() @ torch.from_numpy(
                dequantize(part.gguf_bytes(), w.qtype).reshape(part.shape)).double().t()
            err = float((qlinear(x, part).double() - ref).abs().max() / ref.abs().max())
            print(f"{w.qtype.name}: {t.name} {w.shape}, kernel vs gguf-py's dequantization: max rel error {err:.1e}")
            if err > 1e-5:
                raise SystemExit(f"the {w.qtype.name} kernel disagrees with gguf-py on {t.name}")
            checked.add(w.qtype)
        lib = native_backend.library(isa) if isa else None
        run = (lambda x, w=w, lib=lib: qtensor.run_qlinear(lib, x, w)) if lib is not None else (lambda x, w=w: qlinear(x, w))
        fns.append((run, w.shape[1], torch.float32, w.nbytes))
        shapes[t.name] = w.shape
    return fns, shapes


def bf16_fns(kind: str, shapes: dict) -> list:
    fns = []
    for n, k in shapes.values():
        cls = model_mod.Linear if kind == "bf16 specfleet" else torch.nn.Linear
        lin = cls(k, n, bias=False).to(torch.bfloat16)
        fns.append((lin, k, torch.bfloat16, n * k * 2))
    return fns


@torch.inference_mode()
def time_all(systems: dict, rows: list[int], repeats: int, clock=time.perf_counter) -> dict:
    """Best time of one pass through each system's layers, per row count; systems alternate order."""
    best = {name: {} for name in systems}
    for m in rows:
        xs = {name: [torch.randn(m, k, dtype=dt) for _, k, dt, _ in fns] for name, fns in systems.items()}
        order = list(systems)
        for rep in range(repeats + 1):  # the first pass warms up
            for name in (order if rep % 2 == 0 else order[::-1]):
                t0 = clock()
                for (f, _, _, _), x in zip(systems[name], xs[name]):
                    f(x)
                dt = clock() - t0
                if rep:
                    best[name][m] = min(best[name].get(m, float("inf")), dt)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 9, 16, 32, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--head", action="store_true", help="also the 151936 x 1536 output head")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gguf", default=None, help="time every matrix of this GGUF file instead (no bf16 systems)")
    ap.add_argument("--isa", nargs="+", default=None, choices=list(native_backend.ISA_PATHS),
                    help="time each format on these kernel ISA paths side by side (default: the one in use)")
    ap.add_argument("--no-bf16", action="store_true", help="leave out the bf16 systems")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="thread: the calling thread's CPU time (needs --threads 1)")
    args = ap.parse_args()
    if args.clock == "thread" and args.threads != 1:
        ap.error("--clock thread measures one thread's CPU time: use it with --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native_backend.available():
        print(f"the native kernels are UNAVAILABLE here ({native_backend.unavailable_reason()}): timing the fallback")
    load_before = os.getloadavg()[0]  # other processes on a shared machine: in the report
    if args.gguf:
        systems = {}
        for path in args.isa or [None]:  # the file's matrices through each ISA path named (alternating)
            fns, shapes = gguf_fns(args.gguf, path)
            systems[f"gguf file {path}" if path else "gguf file"] = fns
    else:
        shapes = {**SHAPES, **(HEAD if args.head else {})}
        rng = np.random.default_rng(0)
        paths = args.isa or [None]
        systems = {f"{name} {path}" if path else name: quant_fns(T[name], shapes, rng, path)
                   for name in args.formats for path in paths}
        if not args.no_bf16:
            systems["bf16 torch"] = bf16_fns("bf16 torch", shapes)
            systems["bf16 specfleet"] = bf16_fns("bf16 specfleet", shapes)
    best = time_all(systems, args.rows, args.repeats, time.thread_time if args.clock == "thread" else time.perf_counter)
    table, one = [], args.rows[0]
    flops_per_row = 2 * sum(n * k for n, k in shapes.values())
    for name, times in best.items():
        nbytes = sum(b for *_, b in systems[name])
        for m, t in times.items():
            table.append({"weights": name, "rows": m, "ms": 1e3 * t, "vs_one_row": t / times[one],
                          "GB_per_s": nbytes / t / 1e9 if m == 1 else None,
                          "GFLOP_per_s": flops_per_row * m / t / 1e9})
        top = max(times)
        print(f"{name:15} 1 row {1e3 * times[one]:7.2f} ms ({nbytes / times[one] / 1e9:5.1f} GB/s)  "
              + " ".join(f"{m}:{times[m] / times[one]:.2f}x" for m in args.rows[1:])
              + f"  {top} rows {flops_per_row * top / times[top] / 1e9:6.1f} GFLOP/s", flush=True)
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "(unset: libgomp spins)")
    load = (load_before, os.getloadavg()[0])
    payload = {"args": vars(args), "shapes": shapes, "threads": torch.get_num_threads(), "omp_wait_policy": wait_policy,
               "kernel_isa": native_backend.isa(), "runnable_isas": native_backend.runnable_isas(),
               "load_average_1min": load,
               "native_available": native_backend.available(), "native_unavailable_reason": native_backend.unavailable_reason(),
               "results": {name: {str(m): t for m, t in times.items()} for name, times in best.items()}}
    if args.gguf:
        what = f"every matrix of {args.gguf} but the embedding ({len(shapes)} of them, in the file's formats)"
    else:
        what = (", ".join(f"{k} {n}x{kk}" for k, (n, kk) in shapes.items()) + " (N x K) with random weights in "
                "each block format, against bf16 weights through torch's F.linear and through specfleet's bf16 "
                "routes (runtime/backends/cpu.py)")
    body = (f"One pass through the linear layers: {what}. Block formats run runtime/formats/qtensor.py's native kernels "
            "(int8 activations, integer dot products). Best of repeats, systems alternating; "
            f"kernel ISA path {args.isa or native_backend.isa()}; {torch.get_num_threads()} threads, OMP_WAIT_POLICY {wait_policy}, {args.clock} clock; the machine's "
            f"1-minute load average {load[0]:.1f} before and {load[1]:.1f} after (other work shares the cores). "
            "GB_per_s: weight bytes read per second at one row; GFLOP_per_s: 2 x rows x weights per second.\n\n"
            + md_table(table, ["weights", "rows", "ms", "vs_one_row", "GB_per_s", "GFLOP_per_s"]))
    print(write_results("qkernels", payload, body, device="cpu", dtype="gguf blocks / bf16"))


if __name__ == "__main__":
    main()
