"""A draft of another model family against plain decoding, side by side in one run.

A Qwen target (default qwen-0.5b) with SmolLM2-135M-Instruct as cross-vocabulary draft
(drafting/cross_vocab.py), the first N HumanEval prompts (raw completion), greedy, batch 1, weights as
loaded by default (GGUF files run natively on the CPU). Per prompt the systems run in a rotating order,
so drift on a shared machine falls on each alike. Prints per system: acceptance rate, mean accepted
length, tok/s (new tokens over the generate call's wall time, prefill included), and whether every
output equals plain greedy; writes benchmarks/results/cross_vocab-cpu-<time>.json and .md.

    python benchmarks/drafts/cross_vocab.py [--target qwen-0.5b] [--drafts "SPEC;SPEC"]
                                           [--prompts 4] [--tokens 40] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch

from specfleet import LLM, SamplingParams
from specfleet.bench.datasets import iter_prompts, select
from specfleet.bench.report import md_table, write_results


def timed(obj, attr: str, totals: dict, fn, key: str | None = None) -> None:
    """Replace obj.attr by `fn` that adds its seconds to totals[key or attr]."""
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[key or attr] += time.perf_counter() - t0

    setattr(obj, attr, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen-0.5b")
    ap.add_argument("--drafts", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [p.text for p in select(iter_prompts("humaneval")[0], args.prompts)]
    base = LLM(args.target, draft=None, dtype=args.dtype)
    systems = {"plain": base}
    for d in args.drafts.split(";"):
        systems[d] = LLM.from_model(base.model, base.tokenizer, d, name=args.target, dtype=args.dtype)
        print(f"{d}: {type(systems[d].engine.proposer).__name__}")
    timers = {name: {"propose": 0.0, "model": 0.0} for name in systems}
    for name, llm in systems.items():
        p = llm.engine.proposer
        if p is not None:
            timed(p, "propose", timers[name], p.propose)
            inner = getattr(p, "inner", None)  # a cross-vocabulary proposer: its draft model's share
            if inner is not None:
                timed(inner, "propose", timers[name], inner.propose, key="model")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    base.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    stats = {name: {"tokens": 0, "seconds": 0.0, "outputs": [], "drafted": 0, "accepted": 0, "steps": 0, "emitted": 0,
                    "decode_s": 0.0}
             for name in systems}
    names = list(systems)
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            out = systems[name].generate(prompt, params, use_tqdm=False)[0]
            s = stats[name]
            s["seconds"] += time.perf_counter() - t0
            s["tokens"] += len(out.token_ids)
            s["outputs"].append(out.token_ids)
            m = out.metrics
            s["steps"] += m.get("steps", 0)
            s["drafted"] += m.get("drafted", 0)
            s["accepted"] += m.get("accepted", 0)
            s["emitted"] += m.get("emitted", 0)
            s["decode_s"] += m.get("latency_s", 0.0) - m.get("ttft_s", 0.0)  # after the first token
    plain = stats["plain"]["outputs"]
    print(f"target {args.target}, {args.prompts} HumanEval prompts x {args.tokens} tokens, greedy, batch 1, "
          f"{args.threads} threads")
    print(f"{'system':28s} {'accept':>7s} {'mean acc len':>12s} {'tok/s':>7s} {'speed-up':>8s} {'draft s':>8s} "
          f"{'text s':>7s} equal-to-plain")
    base_rate = stats["plain"]["tokens"] / stats["plain"]["seconds"]
    p0 = stats["plain"]
    step_s = p0["decode_s"] / max(1, p0["tokens"] - len(prompts))  # a plain decode step of the target
    rows = []
    for name, s in stats.items():
        rate = s["tokens"] / s["seconds"]
        acc = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
        mal = s["emitted"] / s["steps"] if s["steps"] else 1.0
        t = timers[name]  # seconds in propose, and the part outside the draft model (text alignment)
        text_s = t["propose"] - t["model"] if t["model"] else 0.0
        print(f"{name:28s} {acc:7.3f} {mal:12.2f} {rate:7.2f} {rate / base_rate:8.2f} {t['propose']:8.2f} "
              f"{text_s:7.3f} {s['outputs'] == plain}")
        # d: proposer seconds per drafted target token, in plain decode steps of the target
        d = t["propose"] / s["drafted"] / step_s if s["drafted"] else None
        rows.append({"system": name, "acceptance": round(acc, 3), "mean_accepted_length": round(mal, 2),
                     "d": None if d is None else round(d, 3),
                     "tok_s": round(rate, 2), "speed_up": round(rate / base_rate, 2),
                     "draft_s": round(t["propose"], 2), "text_align_s": round(text_s, 3),
                     "seconds": round(s["seconds"], 2), "equal_to_plain": s["outputs"] == plain})
    body = (f"Target `{args.target}` ({args.dtype} activations; GGUF weights as loaded by default), the first "
            f"{args.prompts} HumanEval prompts x {args.tokens} new tokens, greedy, batch 1, {args.threads} threads, "
            "systems in a rotating order per prompt. tok/s counts the generate call's wall time (prefill "
            "included); draft_s is the time inside the proposer, text_align_s the part of it outside the draft "
            "model (text alignment across tokenizers).\n\n"
            + f"d: the proposer's seconds per drafted target token over a plain decode step of the target "
            f"({step_s * 1e3:.1f} ms, this run).\n\n"
            + md_table(rows, ["system", "acceptance", "mean_accepted_length", "d", "tok_s", "speed_up", "draft_s",
                              "text_align_s", "equal_to_plain"]))
    print(write_results("cross_vocab", {"args": vars(args), "systems": rows}, body, device="cpu", dtype=args.dtype))


if __name__ == "__main__":
    main()
