"""How many of each AVX2 instruction this CPU issues a cycle, and which share the integer-multiply pipe.

The AVX2 kernels' products (specfleet/runtime/backends/native/csrc/arch/x86/quants_k.c) spend a Q4_K block and
activation row on eight vpmaddubsw and one vpmaddwd: on a CPU that issues one vector integer multiply a cycle (a
Zen 2) that is nine cycles a block and row at the least, whatever else runs, and so the floor of what a
verification row costs; a CPU that issues two halves it. This measures it rather than trusting a table:
the clock from a chain of dependent scalar adds, then for each instruction eight independent register chains
(its issue rate, per cycle), and four chains of it beside four of vpmaddubsw (the pair's rate: about 2 a cycle
where the two run on different pipes, the multiply's rate alone where they share one). Prints a table and writes
JSON and Markdown under benchmarks/results/.

    .venv/bin/python benchmarks/kernels/ports.py                 # a few seconds, one core
"""
from __future__ import annotations

import argparse
import ctypes
import os
from pathlib import Path

from specfleet.bench.report import md_table, write_results
from specfleet.runtime.backends.native import build as native

SOURCE = Path(__file__).with_name("csrc") / "x86_ports.c"
# what each probe stands for in the kernels
ROLE = {"MADDUBS": "u8 x i8 pair sums (every product)", "MADD": "int16 pairs -> int32 (sub-block totals, Q6_K scales)",
        "PADDW": "int16 sums", "PAND": "nibble masks", "PSHUFB": "scale shuffles, lookup tables",
        "PSIGNB": "signed x signed products", "PSRLW": "high nibbles", "PMULLD": "int32 multiplies",
        "CVT": "int32 -> fp32 (epilogue)", "FMA": "fp32 epilogue"}


def load() -> ctypes.CDLL:
    if native.machine_family() != "x86" or not {"avx2", "fma"} <= native.cpu_flags():
        raise SystemExit("ports.py probes AVX2 + FMA instructions, which this CPU lacks")
    lib = native.compile_library(SOURCE, ["-O2", "-fPIC", "-shared", "-std=c11", "-mavx2", "-mfma", "-Wall", "-Werror"])
    lib.sf_probe_clock.restype = lib.sf_probe_run.restype = ctypes.c_double
    lib.sf_probe_clock.argtypes = [ctypes.c_int64]
    lib.sf_probe_run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    lib.sf_probe_name.restype = ctypes.c_char_p
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50_000_000, help="rounds of eight instructions per probe")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per probe")
    args = ap.parse_args()
    if args.iters < 1000 or args.repeats < 1:
        ap.error("--iters must be >= 1000 and --repeats >= 1")
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core: no migration mid-probe
    lib = load()
    clock_s = min(lib.sf_probe_clock(args.iters) for _ in range(args.repeats))
    ghz = 4 * args.iters / clock_s / 1e9
    rows = []
    for k in range(lib.sf_probe_count()):
        name = lib.sf_probe_name(k).decode()
        alone, beside = (min(lib.sf_probe_run(k, mixed, args.iters) for _ in range(args.repeats)) for mixed in (0, 1))
        rows.append({"instruction": name, "role": ROLE.get(name, ""),
                     "alone_per_cycle": round(8 * args.iters / (alone * ghz * 1e9), 2),
                     "beside_maddubs_per_cycle": round(8 * args.iters / (beside * ghz * 1e9), 2)})
    mul = next(r["alone_per_cycle"] for r in rows if r["instruction"] == "MADDUBS")
    floor = 9 / mul  # eight vpmaddubsw + one vpmaddwd a Q4_K block and activation row
    print(f"clock {ghz:.2f} GHz (dependent scalar adds); vpmaddubsw {mul:.2f} a cycle: a Q4_K block and row "
          f"takes >= {floor:.1f} cycles in the AVX2 kernels")
    cols = ["instruction", "role", "alone_per_cycle", "beside_maddubs_per_cycle"]
    table = md_table(rows, cols, ["instruction", "in the kernels", "a cycle alone", "a cycle beside vpmaddubsw"])
    print(table)
    body = (f"Clock {ghz:.2f} GHz (a chain of dependent scalar adds). vpmaddubsw issues {mul:.2f} a cycle, so a Q4_K "
            f"block and activation row (eight vpmaddubsw, one vpmaddwd) takes at least {floor:.1f} cycles on the AVX2 "
            "path. Beside vpmaddubsw, about 2 a cycle means the instruction runs on another pipe; about the multiply's "
            "own rate means it shares the multiply's pipe.\n\n" + table + "\n")
    path = write_results("ports", {"clock_ghz": round(ghz, 3), "maddubs_per_cycle": mul,
                                   "q4k_block_row_floor_cycles": round(floor, 2), "probes": rows}, body)
    print(path.with_suffix(".json"))


if __name__ == "__main__":
    main()
