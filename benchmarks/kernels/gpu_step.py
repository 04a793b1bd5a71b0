"""The CUDA runtime's step costs at the embedded models' shapes, with random weights (issue 28, item 5).

The device machine reaches no package index, so the real GGUF files cannot travel to it cheaply; the
step costs of a runtime do not depend on the weights' values, only on their shapes and dtype. This builds a
model with the shape of Qwen2.5-Coder-1.5B or -0.5B (random bf16 weights) and measures, per backend:

- `decode_ms`: one decode step after 128 cached tokens, batch 1 and batch 8 (one token per request);
- `c(k)`, k = 1..8: the forward over k+1 new tokens with every row's logits after 128 cached tokens, over
  the one-token forward at the same context (PERFORMANCE.md's cost model);
- `plain_tok_s`: plain greedy generation through the engine, 64 tokens, batch 1 and 8.

Each backend runs in its own process: `graphs` (the invariant kernels with the step shapes that repeat
replayed from captured CUDA graphs, runtime/backends/cuda/graphs.py), `invariant` (runtime/backends/cuda/kernels.py: the
batch-invariant Triton kernels that keep every verified row bit-identical to its decode step, launched
eagerly) and `cublas` (SPECFLEET_CUDA_KERNELS=0: cuBLAS and SDPA, which are not row-invariant; a reference
for what invariance costs).
Every time is the median of `--repeats` runs, each fenced by torch.cuda.synchronize().

    python benchmarks/kernels/gpu_step.py --shape qwen-1.5b qwen-0.5b
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {  # the embedded GGUF models' shapes (their config in the GGUF metadata)
    "qwen-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2),
    "qwen-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
BACKENDS = {"graphs": {"SPECFLEET_CUDA_KERNELS": "1", "SPECFLEET_CUDA_GRAPHS": "1"},
            "invariant": {"SPECFLEET_CUDA_KERNELS": "1", "SPECFLEET_CUDA_GRAPHS": "0"},
            "cublas": {"SPECFLEET_CUDA_KERNELS": "0", "SPECFLEET_CUDA_GRAPHS": "0"}}
CONTEXT = 128
KS = tuple(range(1, 9))


def build(shape: str, device: str, dtype):
    import torch

    from specfleet.runtime.model.decoder import DecoderLM
    from specfleet.runtime.model.config import ModelConfig

    cfg = ModelConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": 151936 if shape != "tiny" else 512,
                                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                                    "tie_word_embeddings": True, "eos_token_id": 151645, **SHAPES[shape]})
    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.to(dtype=dtype).eval()


def child(shape: str, device: str, repeats: int) -> dict:
    import torch

    from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
    from specfleet.engine.engine import Engine
    from specfleet.runtime.backends.cuda import kernels as cuda_kernels
    from specfleet.runtime.step.runner import ForwardItem
    from specfleet.sampling_params import SamplingParams

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build(shape, device, dtype)

    def engine(batch: int) -> Engine:
        return Engine(model, None, EngineConfig(CacheConfig(16, 1 << 30), SchedulerConfig(max_num_seqs=batch)),
                      None, dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    eng = engine(8)
    vocab = model.config.vocab_size
    ids = [(7919 * i) % (vocab - 200) + 100 for i in range(CONTEXT + 16)]

    def forward(batch: int, new: int) -> float:
        """Seconds of a forward of `new` tokens per request (every row's logits) after CONTEXT cached tokens."""
        names = [f"r{b}" for b in range(batch)]
        for n in names:
            eng.blocks.allocate(n, CONTEXT + new)
        try:
            eng.runner.execute([ForwardItem(n, ids[:CONTEXT], 0, [CONTEXT - 1]) for n in names], eng.blocks)
            sync()
            t0 = time.perf_counter()
            eng.runner.execute([ForwardItem(n, ids[CONTEXT:CONTEXT + new], CONTEXT, list(range(new)))
                                for n in names], eng.blocks)
            sync()
            return time.perf_counter() - t0
        finally:
            for n in names:
                eng.blocks.free(n)

    def med(run, n=repeats):
        run()  # warm-up (Triton compiles each new shape once)
        return statistics.median(run() for _ in range(n))

    on = model.runtime.cuda_kernels and cuda_kernels.available(dev)
    graphs = on and model.runtime.cuda_graphs
    out = {"cuda_kernels": ("batch-invariant Triton kernels" + (", CUDA graphs" if graphs else "")) if on else
           ("off (RuntimeConfig.cuda_kernels)" if not model.runtime.cuda_kernels else cuda_kernels.unavailable_reason()),
           "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "-"}
    one = med(lambda: forward(1, 1))
    out["decode_ms_b1"] = one * 1e3
    out["decode_ms_b8"] = med(lambda: forward(8, 1)) * 1e3
    for k in KS:
        out[f"c({k})"] = med(lambda k=k: forward(1, k + 1)) / one
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for batch in (1, 8):
        e = engine(batch)
        prompts = [[(31 * i + 7 * b) % (vocab - 200) + 100 for i in range(32)] for b in range(batch)]
        best = float("inf")
        for _ in range(2):
            for p in prompts:
                e.add_request(p, params)
            sync()
            t0 = time.perf_counter()
            while e.has_unfinished():
                e.step()
            sync()
            best = min(best, time.perf_counter() - t0)
        out[f"plain_tok_s_b{batch}"] = batch * params.max_tokens / best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", default=["qwen-1.5b", "qwen-0.5b"], choices=list(SHAPES))
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.shape[0], args.device, args.repeats)))
        return
    from specfleet.bench.report import md_table, write_results

    rows = []
    for shape in args.shape:
        for name in args.backends:
            env = {**os.environ, **BACKENDS[name]}
            proc = subprocess.run([sys.executable, __file__, "--child", "--shape", shape, "--device", args.device,
                                   "--repeats", str(args.repeats)], env=env, capture_output=True, text=True)
            if proc.returncode:  # reported, and the other backends still run
                print(f"{shape} {name} failed:\n{proc.stderr[-3000:]}", flush=True)
                rows.append({"shape": shape, "backend": name, "error": proc.stderr.strip().splitlines()[-1][:300]})
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"shape": shape, "backend": name, **{k: (round(v, 2) if isinstance(v, float) else v)
                                                            for k, v in res.items()}})
            print(rows[-1], flush=True)
    cols = ["shape", "backend", "decode_ms_b1", "decode_ms_b8", "c(1)", "c(2)", "c(4)", "c(8)", "plain_tok_s_b1",
            "plain_tok_s_b8"]
    cols += ["error"] if any("error" in r for r in rows) else []
    table = md_table(rows, cols)
    print(table)
    body = ("Random bf16 weights in the embedded models' shapes; each backend in its own process; medians of "
            f"{args.repeats} synchronised runs after a warm-up; context {CONTEXT} tokens. c(k): a (k+1)-row forward "
            "with every row's logits over a one-row forward.\n\n" + table)
    print(write_results("gpu-step", {"args": vars(args), "rows": rows}, body, device=args.device,
                        dtype="bfloat16" if args.device.startswith("cuda") else "float32"))


if __name__ == "__main__":
    main()
