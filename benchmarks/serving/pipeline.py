"""Pipelined against plain speculative decoding, at several batch sizes, with the target's idle time.

Full run (the embedded family, bf16; on 2 CPU cores expect roughly 30-60 minutes):

    .venv/bin/python benchmarks/serving/pipeline.py --batch-sizes 8 16 --max-tokens 64

Smoke run (a few seconds once the model is cached):

    .venv/bin/python benchmarks/serving/pipeline.py --target smollm2-135m-instruct \
        --draft smollm2-135m-instruct@10 --batch-sizes 2 --max-tokens 8

"Target idle" is the time the target waits for drafts: in plain mode every drafting call (the
engine drafts between verifications), in pipelined mode the time step() waits on an empty pool.
Both runs are greedy, so their outputs must match; the table says whether they did.
"""
from __future__ import annotations

import argparse
import time

import torch

from specfleet.bench.report import md_table, write_results
from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.engine.engine import Engine
from specfleet.engine.pipelined import PipelinedEngine
from specfleet.runtime.loading.load import load_model
from specfleet.runtime.loading.build import parse_device, parse_dtype
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.engine.result_pool import PipelineConfig

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Implement binary search over a sorted list in Python and explain the loop invariant.",
    "Write a function that merges two sorted lists into one sorted list.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "Parse a CSV line with quoted fields in Python without the csv module.",
    "Write a function that counts word frequencies in a text and returns the top 5.",
    "Implement a least-recently-used cache in Python.",
    "Write a function that flattens a nested list of arbitrary depth.",
    "Write a SQL query that returns the second highest salary from an employees table.",
    "Write a Python function that validates an IPv4 address string.",
    "Implement quicksort in Python.",
    "Write a function that rotates a matrix by 90 degrees clockwise.",
    "Write a Python generator that yields prime numbers.",
    "Write a function that removes duplicates from a list while keeping order.",
]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--micro-batches", default="auto", help="SPIN's m: a number, or 'auto' to search")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU intra-op threads for the whole process (the plain baseline uses these)")
    ap.add_argument("--split-threads", default=None,
                    help="CPU only: 'T,D' intra-op threads for the target and the drafter in pipelined mode")
    ap.add_argument("--remote-workers", type=int, default=0, help="draft in this many Ray actors instead")
    return ap.parse_args()


def encode(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def run(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float]:
    reqs = [engine.add_request(p, params) for p in prompts]
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    return [list(r.output_token_ids) for r in reqs], wall


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype, device = parse_dtype(args.dtype), parse_device(args.device)
    target, tokenizer = load_model(args.target, dtype, device)
    draft, _ = load_model(args.draft, dtype, device, with_tokenizer=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    m = None if args.micro_batches == "auto" else int(args.micro_batches)
    split = tuple(int(x) for x in args.split_threads.split(",")) if args.split_threads else (None, None)
    spec_cfg = DraftModelConfig(args.num_speculative_tokens, kv_cache_bytes=256 << 20)
    remote = []
    if args.remote_workers:
        from specfleet.drafting.remote import RemoteDraftSpec, remote_drafters, require_ray

        require_ray().init(include_dashboard=False, ignore_reinit_error=True)
        remote = remote_drafters(RemoteDraftSpec(args.draft, spec_cfg, args.dtype, args.device,
                                                 target.config.vocab_size), args.remote_workers)
    rows, payload = [], {"args": vars(args), "runs": []}
    default_threads = torch.get_num_threads()
    for batch in args.batch_sizes:
        prompts = [encode(tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
        config = EngineConfig(CacheConfig(16, 1 << 30), SchedulerConfig(max_num_seqs=batch))
        plain_eng = Engine(target, tokenizer, config, DraftModelProposer(draft, args.draft, spec_cfg,
                                                                          target.config.vocab_size, device), device)
        run(plain_eng, prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        plain_eng.stats.draft_time = plain_eng.stats.verify_time = 0.0
        emitted0 = plain_eng.stats.num_emitted
        plain_out, plain_wall = run(plain_eng, prompts, params)
        s = plain_eng.stats
        plain = {"batch": batch, "mode": "plain", "tok_s": (s.num_emitted - emitted0) / plain_wall,
                 "wall_s": plain_wall, "target_idle_s": s.draft_time,
                 "target_idle_pct": 100 * s.draft_time / plain_wall, "draft_idle_pct": 100 * s.verify_time / plain_wall,
                 "mean_accepted_length": s.mean_accepted_length}
        drafters = remote or [DraftModelProposer(draft, args.draft, spec_cfg, target.config.vocab_size, device)]
        pc = PipelineConfig(num_micro_batches=m, target_threads=split[0], draft_threads=split[1])
        with PipelinedEngine(target, tokenizer, config, drafters=drafters, device=device, pipeline=pc) as eng:
            pipe_out, pipe_wall = run(eng, prompts, params)
        torch.set_num_threads(default_threads)  # the split applies to this thread; undo it for the next run
        ps = eng.pipeline_stats()
        busy = sum(ps["draft_busy_s"]) + sum(ps["draft_idle_s"])
        pipe = {"batch": batch, "mode": f"pipelined m={ps['num_micro_batches']}", "tok_s": ps["throughput_tok_s"],
                "wall_s": pipe_wall, "target_idle_s": ps["target_idle_s"],
                "target_idle_pct": 100 * ps["target_idle_s"] / pipe_wall,
                "draft_idle_pct": 100 * sum(ps["draft_idle_s"]) / max(busy, 1e-9),
                "mean_accepted_length": eng.stats.mean_accepted_length,
                "pool_mean": ps["pool_occupancy_mean"], "pool_max": ps["pool_occupancy_max"],
                "pool_bound": ps["pool_capacity"], "speedup": ps["throughput_tok_s"] / plain["tok_s"],
                "same_output": pipe_out == plain_out}
        rows += [plain, pipe]
        payload["runs"].append({"plain": plain, "pipelined": pipe, "pipeline_stats": ps})
        for r in (plain, pipe):
            print(f"batch {batch:3d}  {r['mode']:<15} {r['tok_s']:8.2f} tok/s  target idle {r['target_idle_s']:7.2f} s "
                  f"({r['target_idle_pct']:4.1f}%)" + (f"  speedup {r['speedup']:.2f}x  same output: {r['same_output']}"
                                                       if "speedup" in r else ""), flush=True)
    for d in remote:
        d.close()
    cols = ["batch", "mode", "tok_s", "speedup", "wall_s", "target_idle_s", "target_idle_pct", "draft_idle_pct",
            "mean_accepted_length", "pool_mean", "pool_max", "pool_bound", "same_output"]
    body = (f"target `{args.target}`, draft `{args.draft}`, {args.max_tokens} new tokens per prompt, greedy, "
            f"k = {args.num_speculative_tokens}, split threads {args.split_threads or 'no'}, "
            f"remote workers {args.remote_workers}\n\n" + md_table(rows, cols))
    print(write_results("pipeline", payload, body, device=str(device), dtype=args.dtype))


if __name__ == "__main__":
    main()
