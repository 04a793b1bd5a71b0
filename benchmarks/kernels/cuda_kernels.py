"""The batch-invariant CUDA kernels (runtime/backends/cuda/kernels.py) against cuBLAS / SDPA, at the shapes of the
embedded 1.5B (d=1536, 12/2 heads of 128, MLP 8960, vocab 151,936), bf16: microseconds per call for the
row counts of decode (1), verification (5, 17, 8x5) and prompt chunks (512), and whether each row equals
the same row computed alone (the property the kernels exist for). Needs a CUDA GPU.

    python benchmarks/kernels/cuda_kernels.py [--out FOLDER]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from specfleet.runtime.backends.cuda import kernels as cuda_kernels  # noqa: E402

SHAPES = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536),
          "head": (1536, 151936)}
ROWS = (1, 5, 17, 40, 512)


def _time(fn, reps=50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder (default: benchmarks/results/cuda-kernels-cuda-<UTC stamp>)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ours = cuda_kernels.linear(x, w)
            alone = torch.stack([cuda_kernels.linear(x[i:i + 1], w)[0] for i in range(min(m, 8))])
            cublas = F.linear(x, w)
            cublas_alone = torch.stack([F.linear(x[i:i + 1], w)[0] for i in range(min(m, 8))])
            rows.append({"op": f"linear {name}", "rows": m,
                         "triton_us": round(_time(lambda: cuda_kernels.linear(x, w)), 1),
                         "cublas_us": round(_time(lambda: F.linear(x, w)), 1),
                         "triton_rows_equal_alone": bool(torch.equal(ours[:len(alone)], alone)),
                         "cublas_rows_equal_alone": bool(torch.equal(cublas[:len(cublas_alone)], cublas_alone))})
            print(rows[-1], flush=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
            "command": " ".join(sys.argv), "rows": rows}
    from specfleet.bench.report import result_path, run_metadata, write_folder

    meta = run_metadata("cuda-kernels", "cuda", "bfloat16")
    out = Path(args.out) if args.out else result_path(meta)
    lines = [f"CUDA kernels vs cuBLAS, {info['device']}, torch {info['torch']}, bf16", "",
             "| op | rows | ours µs | cuBLAS µs | ours: row = row alone | cuBLAS: row = row alone |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['rows']} | {r['triton_us']} | {r['cublas_us']} | {r['triton_rows_equal_alone']} | "
              f"{r['cublas_rows_equal_alone']} |" for r in rows]
    json_path, _ = write_folder(out, meta, info, "\n".join(lines))
    print(json_path)


if __name__ == "__main__":
    main()
