"""fleet(...) against each of its drafts alone and plain decoding, side by side in one run.

SmolLM2-135M-Instruct in fp32 as the target, the first N HumanEval prompts (raw completion), greedy,
batch 1; the drafts are the target's first 8 layers, prompt lookup and the online n-gram model. Per
prompt the systems run in a rotating order, so drift on a shared machine falls on each alike. Prints
per system: mean accepted length, tok/s (new tokens over the generate call's wall time, prefill
included) and whether every output equals plain greedy; then what the fleet measured and chose.

    python benchmarks/drafts/fleet.py [--prompts 4] [--tokens 48] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from specfleet import LLM, SamplingParams
from specfleet.bench.datasets import iter_prompts, select

TARGET = "smollm2-135m-instruct"
MODEL_DRAFT = f"{TARGET}@8"
DRAFTS = [MODEL_DRAFT, "prompt-lookup", "ngram", f"fleet({MODEL_DRAFT},prompt-lookup,ngram)"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [p.text for p in select(iter_prompts("humaneval")[0], args.prompts)]
    base = LLM(TARGET, draft=None, dtype="float32")
    systems = {"plain": base}
    for d in DRAFTS:
        systems[d] = LLM.from_model(base.model, base.tokenizer, d, name=TARGET, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for llm in systems.values():  # warm-up, not counted
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    stats = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in systems}
    names = list(systems)
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            out = systems[name].generate(prompt, params, use_tqdm=False)[0]
            stats[name]["seconds"] += time.perf_counter() - t0
            stats[name]["tokens"] += len(out.token_ids)
            stats[name]["outputs"].append(out.token_ids)
    print(f"{len(prompts)} HumanEval prompts, {args.tokens} new tokens, greedy, batch 1, fp32, {args.threads} thread(s)")
    print(f"{'system':<48} {'mean acc len':>12} {'tok/s':>7} {'vs plain':>9} {'same output':>12}")
    plain_rate = stats["plain"]["tokens"] / stats["plain"]["seconds"]
    for name, llm in systems.items():
        s = stats[name]
        rate = s["tokens"] / s["seconds"]
        mal = llm.engine.stats.mean_accepted_length if name != "plain" else 1.0
        print(f"{name:<48} {mal:>12.2f} {rate:>7.2f} {rate / plain_rate:>8.2f}x "
              f"{str(s['outputs'] == stats['plain']['outputs']):>12}")
    fleet = systems[DRAFTS[-1]].engine.proposer
    print("fleet report:", json.dumps(fleet.fleet_report(), indent=1))
    print("engine drafts_used:", systems[DRAFTS[-1]].engine.stats.as_dict()["drafts_used"])


if __name__ == "__main__":
    main()
