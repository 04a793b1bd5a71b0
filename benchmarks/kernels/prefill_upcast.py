"""Prefill (time to first token) of the bf16 target with and without the sliced fp32 upcast of CPU
batches (runtime/backends/cpu.py, `SPECFLEET_CPU_UPCAST_ROWS`), side by side in one process.

    .venv/bin/python benchmarks/kernels/prefill_upcast.py            # about a minute on 2 CPU cores
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import specfleet.runtime.model.decoder as model_mod
from specfleet.bench.report import md_table, write_results
from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.engine.engine import Engine
from specfleet.runtime.loading.load import load_model
from specfleet.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[32, 128, 256])
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    model, _ = load_model(args.model, torch.bfloat16, torch.device("cpu"), with_tokenizer=False)
    default = model_mod.DEFAULT_RUNTIME.upcast_rows
    rows, payload = [], {"args": vars(args), "default_upcast_rows": default, "results": []}
    g = torch.Generator().manual_seed(0)
    warm = Engine(model, None, EngineConfig(CacheConfig(16, 64 << 20), SchedulerConfig()))
    warm.add_request(list(range(100, 140)), SamplingParams(temperature=0, max_tokens=2))  # both paths, once
    while warm.has_unfinished():
        warm.step()
    del warm
    for n in args.prompt_tokens:
        prompt = torch.randint(100, 20000, (n,), generator=g).tolist()
        times = {}
        for label, threshold in (("bf16 matmuls", 0), (f"fp32 upcast from {default or 16} rows", default or 16)):
            model.set_runtime(dataclasses.replace(model_mod.DEFAULT_RUNTIME, upcast_rows=threshold))
            best = float("inf")
            for _ in range(args.repeats):
                eng = Engine(model, None, EngineConfig(CacheConfig(16, 256 << 20),
                                                       SchedulerConfig(max_num_batched_tokens=4096)))
                eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
                t0 = time.perf_counter()
                while eng.has_unfinished():
                    eng.step()
                best = min(best, time.perf_counter() - t0)
            times[label] = best
            rows.append({"prompt_tokens": n, "path": label, "prefill_s": best, "tok_s": n / best})
            print(f"{n:5d} tokens  {label:28} {best:7.2f} s  ({n / best:7.1f} tok/s)", flush=True)
        rows[-1]["speedup"] = times["bf16 matmuls"] / best
        payload["results"].append({"prompt_tokens": n, **times})
    body = (f"`{args.model}` in bf16 on the CPU: one prompt's prefill (first token), best of {args.repeats}; "
            "same weights, the linear layers in bf16 or converted to fp32 per call.\n\n"
            + md_table(rows, ["prompt_tokens", "path", "prefill_s", "tok_s", "speedup"]))
    print(write_results("prefill", payload, body, device="cpu", dtype="bfloat16"))


if __name__ == "__main__":
    main()
