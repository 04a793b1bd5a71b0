"""Suffix drafting against prompt lookup and plain decoding, side by side in one run.

SmolLM2-135M-Instruct in fp32, the first N HumanEval prompts (raw completion), greedy, batch 1. Per
prompt the systems run in a rotating order, so drift on a shared machine falls on each alike. Prints
per system: mean accepted length, tok/s (new tokens over the generate call's wall time, prefill
included) and microseconds per propose call.

    python benchmarks/drafts/suffix.py [--prompts 5] [--tokens 64] [--threads 1] [--drafts suffix,prompt-lookup]
"""
from __future__ import annotations

import argparse
import time

import torch

from specfleet import LLM, SamplingParams
from specfleet.bench.datasets import iter_prompts, select


def timed_propose(proposer, totals: dict) -> None:
    """Wrap `proposer.propose` to add its calls and seconds to `totals`."""
    inner = proposer.propose

    def propose(requests):
        t0 = time.perf_counter()
        trees = inner(requests)
        totals["calls"] += 1
        totals["seconds"] += time.perf_counter() - t0
        return trees

    proposer.propose = propose


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--drafts", default="suffix,prompt-lookup")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [p.text for p in select(iter_prompts("humaneval")[0], args.prompts)]
    base = LLM("smollm2-135m-instruct", draft=None, dtype="float32")
    systems = {"plain": base}
    for d in args.drafts.split(","):
        systems[d] = LLM.from_model(base.model, base.tokenizer, d, name="smollm2-135m-instruct", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    base.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    stats = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in systems}
    propose_totals = {name: {"calls": 0, "seconds": 0.0} for name in systems}
    for name, llm in systems.items():
        if llm.engine.proposer is not None:
            timed_propose(llm.engine.proposer, propose_totals[name])
    names = list(systems)
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            out = systems[name].generate(prompt, params, use_tqdm=False)[0]
            stats[name]["seconds"] += time.perf_counter() - t0
            stats[name]["tokens"] += len(out.token_ids)
            stats[name]["outputs"].append(out.token_ids)
    plain_outputs = stats["plain"]["outputs"]
    print(f"{len(prompts)} HumanEval prompts, {args.tokens} new tokens, greedy, batch 1, fp32, "
          f"{args.threads} thread(s)")
    print(f"{'system':<16} {'mean acc len':>12} {'tok/s':>8} {'vs plain':>9} {'us/propose':>11} {'same output':>12}")
    plain_rate = stats["plain"]["tokens"] / stats["plain"]["seconds"]
    for name, llm in systems.items():
        s, pt = stats[name], propose_totals[name]
        rate = s["tokens"] / s["seconds"]
        us = 1e6 * pt["seconds"] / pt["calls"] if pt["calls"] else 0.0
        mal = llm.engine.stats.mean_accepted_length if name != "plain" else 1.0
        print(f"{name:<16} {mal:>12.2f} {rate:>8.2f} {rate / plain_rate:>8.2f}x {us:>11.1f} "
              f"{str(s['outputs'] == plain_outputs):>12}")


if __name__ == "__main__":
    main()
