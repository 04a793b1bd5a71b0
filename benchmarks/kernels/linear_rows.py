"""How the cost of the target's linear layers grows with the number of rows (tokens) in one forward.

Speculative verification and batching are worth it only where k rows cost much less than k single
rows. This measures, for the Qwen2.5-1.5B layer shapes, the time of one forward through all four
linear layers of a decoder layer with 1..32 rows, in bf16, fp32 and the weight-only int8 kernel that
`quantization="int8"` uses (runtime/formats/quant.py), and prints the ratio to one row of the same kind and to
one row of torch's kernel for that dtype. bf16 runs three ways: torch's `F.linear` ("torch"), the
project's CPU routes ("specfleet", runtime/backends/cpu.py: the native kernel up to `RuntimeConfig.native_rows` rows, then
the sliced fp32 upcast) and the routes without the native kernel ("sliced"); fp32 runs through torch and
the project's W @ x^T route.

    .venv/bin/python benchmarks/kernels/linear_rows.py            # about a minute on 2 CPU cores
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from specfleet.bench.report import md_table, write_results
from specfleet.runtime.backends.bind import bind_linear
from specfleet.runtime.model import decoder as model_mod
from specfleet.runtime.backends.native import kernels as native_backend
from specfleet.runtime.formats.quant import Int8Linear

# Qwen2.5-Coder-1.5B: hidden 1536, 12 q heads + 2 kv heads of 128, MLP 8960 (gate and up fused)
SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}


def layer_fns(kind: str, dtype: torch.dtype):
    fns = []
    for out_f, in_f in SHAPES.values():
        cls = model_mod.Linear if kind.endswith(("specfleet", "sliced")) else torch.nn.Linear
        lin = cls(in_f, out_f, bias=False).to(dtype)
        if kind == "bf16 sliced":  # specfleet's routes without the native kernel
            bind_linear(lin, torch.device("cpu"), dataclasses.replace(model_mod.DEFAULT_RUNTIME, native_rows=0))
        elif kind.endswith("specfleet"):
            bind_linear(lin, torch.device("cpu"), model_mod.DEFAULT_RUNTIME)
        if kind.startswith("int8"):
            fns.append((Int8Linear.from_linear(lin), in_f, dtype))
        else:
            fns.append((lin, in_f, dtype))
    return fns


@torch.inference_mode()
def time_layer(fns, rows: int, repeats: int) -> float:
    xs = [torch.randn(rows, in_f, dtype=dt) for _, in_f, dt in fns]
    for _ in range(2):
        for (f, _, _), x in zip(fns, xs):
            f(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for (f, _, _), x in zip(fns, xs):
            f(x)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_out, payload = [], {"args": vars(args), "shapes": SHAPES, "results": {}}
    kinds = (("bf16 torch", torch.bfloat16), ("bf16 specfleet", torch.bfloat16), ("bf16 sliced", torch.bfloat16),
             ("fp32 torch", torch.float32),
             ("fp32 specfleet", torch.float32), ("int8", torch.bfloat16), ("int8-fp32act", torch.float32))
    rt = model_mod.DEFAULT_RUNTIME
    payload["upcast_rows"], payload["weight_left"] = rt.upcast_rows, rt.weight_left
    payload["native_rows"], payload["native_available"] = rt.native_rows, native_backend.available()
    payload["native_unavailable_reason"] = native_backend.unavailable_reason()
    torch_one_row = {}
    for kind, dtype in kinds:
        fns = layer_fns(kind, dtype)
        times = {r: time_layer(fns, r, args.repeats) for r in args.rows}
        payload["results"][kind] = {str(r): t for r, t in times.items()}
        family = kind.split()[0]
        torch_one_row.setdefault(family, times[args.rows[0]])
        for r, t in times.items():
            rows_out.append({"weights": kind, "rows": r, "ms_per_layer": 1e3 * t, "vs_one_row": t / times[args.rows[0]],
                             "vs_torch_one_row": t / torch_one_row[family],
                             "ms_per_row": 1e3 * t / r, "x_28_layers_ms": 28e3 * t})
            print(f"{kind:14} rows {r:3d}: {1e3 * t:8.2f} ms per layer ({t / times[args.rows[0]]:.2f}x one row, "
                  f"{t / torch_one_row[family]:.2f}x torch's one row)", flush=True)
    body = ("One decoder layer's four linear layers (qkv, o, gate_up, down) at the Qwen2.5-1.5B shapes; "
            "best of repeats; int8 = weight-only per-channel int8 with bf16 activations (int8-fp32act: fp32 ones) "
            f"(`aten._weight_int8pack_mm`). torch = `F.linear`; specfleet = runtime/backends/cpu.py (fp32: W @ x^T from "
            f"2 rows; bf16: the native kernel up to {rt.native_rows} rows"
            f"{'' if native_backend.available() else ' (UNAVAILABLE here: ' + str(native_backend.unavailable_reason()) + ')'}"
            f", then the sliced fp32 upcast from {rt.upcast_rows} rows); sliced = specfleet without the native "
            "kernel. vs_torch_one_row: against the first kind of the same dtype's one row (bf16, fp32: torch; "
            "int8 and int8-fp32act: their own).\n\n"
            + md_table(rows_out, ["weights", "rows", "ms_per_layer", "vs_one_row", "vs_torch_one_row", "ms_per_row",
                                  "x_28_layers_ms"]))
    print(write_results("kernels", payload, body, device="cpu", dtype="bf16/fp32/int8"))


if __name__ == "__main__":
    main()
