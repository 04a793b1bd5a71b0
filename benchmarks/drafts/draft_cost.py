"""What a draft costs and brings, per variant, on the embedded 1.5B target: d, acceptance and speed-up.

    python benchmarks/drafts/draft_cost.py                                   # the default variants, 2 rounds
    python benchmarks/drafts/draft_cost.py --variants "qwen-0.5b;qwen-0.5b[quant=q4_0,p_min=0.4]" --rounds 3

Every variant (a draft spec, `none` = plain decoding) runs greedy on the same HumanEval prompts in each
round, in an order that alternates from round to round; each round takes its own prompts (round r the
r-th slice), so a draft that learns across requests (the suffix tree) meets new text every round, as a
user's session does. The target is loaded once and shared (LLM.from_model). Per variant and round:

- tok/s and the ratio to plain decoding in the same round (the speed-up);
- tokens per step, drafted tokens per step, acceptance per drafted token (accepted / drafted) and per-token
  acceptance (accepted / judged: the chance the target keeps a drafted token whose prefix it kept, the alpha of
  the speculative-sampling papers, also by position; core/stats.py);
- reach by depth: the share of steps whose accepted run reached depth j (j = 1..k);
- d: the variant's drafting seconds per drafted token over the plain step (1 / plain tok/s, same round);
- verify: the target's seconds per speculative step over the plain step (the c(k) the variant paid);
- whether its output equals plain decoding's, token for token (it must: speculation is lossless).

Medians over rounds are printed and written under benchmarks/results/ (JSON and Markdown).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

from specfleet.bench.report import md_table, write_results

DEFAULT_VARIANTS = ("none;fleet(suffix,prompt-lookup);qwen-0.5b;qwen-0.5b[p_min=0.4];qwen-0.5b[quant=q4_0];"
                    "qwen-0.5b[quant=q4_0,p_min=0.4];fleet(qwen-0.5b[quant=q4_0,p_min=0.4],suffix,prompt-lookup)")


def run_variant(llm, prompts: list[list[int]], tokens: int) -> dict:
    from specfleet.sampling_params import SamplingParams

    s = llm.engine.stats
    before = (s.num_steps, s.num_drafted, s.num_accepted, s.draft_time, s.verify_time, list(s.accepted_at_depth),
              s.num_judged, list(s.judged_at_depth))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs, wall = [], 0.0
    for p in prompts:
        t0 = time.perf_counter()
        outs.append(llm.generate([p], params)[0].token_ids)
        wall += time.perf_counter() - t0
    steps, drafted, accepted = s.num_steps - before[0], s.num_drafted - before[1], s.num_accepted - before[2]
    depth_before = before[5] + [0] * (len(s.accepted_at_depth) - len(before[5]))
    reach = [a - b for a, b in zip(s.accepted_at_depth, depth_before)]
    judged_before = before[7] + [0] * (len(s.judged_at_depth) - len(before[7]))
    judged = [a - b for a, b in zip(s.judged_at_depth, judged_before)]
    n = sum(map(len, outs))
    return {"tok_s": n / wall, "tokens": n, "steps": steps, "drafted": drafted, "accepted": accepted,
            "draft_s": s.draft_time - before[3], "verify_s": s.verify_time - before[4],
            "reach": [round(x / max(steps, 1), 3) for x in reach], "judged": s.num_judged - before[6],
            "alpha_by_position": [round((reach[k] if k < len(reach) else 0) / j, 3) for k, j in enumerate(judged) if j],
            "hash": hashlib.sha1(json.dumps(outs).encode()).hexdigest()[:12]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="';'-separated draft specs ('none': plain)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per round")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dataset", default="humaneval")
    args = ap.parse_args()

    from specfleet.bench.datasets import iter_prompts, select
    from specfleet.llm import LLM
    from specfleet.sampling_params import SamplingParams

    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    if "none" not in variants:
        variants.insert(0, "none")
    src, _ = iter_prompts(args.dataset)
    texts = [p.text for p in select(src, args.prompts * args.rounds)]
    base = LLM("qwen-1.5b", draft=None)
    ids = [base.tokenizer.encode(t) for t in texts]
    llms = {"none": base}
    for v in variants:
        if v != "none":
            llms[v] = LLM.from_model(base.model, base.tokenizer, draft=v, name="qwen2.5-coder-1.5b-instruct")
    for llm in llms.values():  # warm-up: kernels, caches, each draft's first load
        llm.generate(ids[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    per: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        prompts = ids[r * args.prompts:(r + 1) * args.prompts]
        order = variants if r % 2 == 0 else variants[::-1]
        res = {v: run_variant(llms[v], prompts, args.tokens) for v in order}
        plain = res["none"]
        step = 1.0 / plain["tok_s"]
        for v in variants:
            x = res[v]
            x["speedup"] = x["tok_s"] / plain["tok_s"]
            x["tokens_per_step"] = x["tokens"] / max(x["steps"], 1)
            x["drafted_per_step"] = x["drafted"] / max(x["steps"], 1)
            x["acceptance"] = x["accepted"] / x["drafted"] if x["drafted"] else None
            x["per_token_acceptance"] = x["accepted"] / x["judged"] if x["judged"] else None
            x["d"] = x["draft_s"] / x["drafted"] / step if x["drafted"] else None
            x["verify_steps"] = x["verify_s"] / max(x["steps"], 1) / step
            x["same_as_plain"] = x["hash"] == plain["hash"]
            per[v].append(x)
            print(f"round {r} {v:60s} {x['tok_s']:6.2f} tok/s  x{x['speedup']:.2f}  {x['tokens_per_step']:.2f} tok/step  "
                  f"acc {x['acceptance'] if x['acceptance'] is None else round(x['acceptance'], 2)}  "
                  f"alpha {x['per_token_acceptance'] if x['per_token_acceptance'] is None else round(x['per_token_acceptance'], 2)}  "
                  f"d {x['d'] if x['d'] is None else round(x['d'], 3)}  verify {x['verify_steps']:.2f}  "
                  f"same={x['same_as_plain']}", flush=True)

    def med(v, key):
        vals = [x[key] for x in per[v] if x[key] is not None]
        return round(statistics.median(vals), 3) if vals else None

    rows = [{"draft": v, "tok/s": med(v, "tok_s"), "speed-up": med(v, "speedup"), "tok/step": med(v, "tokens_per_step"),
             "drafted/step": med(v, "drafted_per_step"), "acceptance": med(v, "acceptance"),
             "per-token acceptance": med(v, "per_token_acceptance"), "d": med(v, "d"),
             "verify (steps)": med(v, "verify_steps"), "reach by depth": per[v][-1]["reach"],
             "per-token acceptance by depth": per[v][-1]["alpha_by_position"],
             "= plain": all(x["same_as_plain"] for x in per[v])} for v in variants]
    cols = list(rows[0])
    print(md_table(rows, cols))
    body = (f"Target qwen-1.5b (GGUF, native kernels), greedy, {args.dataset}, {args.prompts} prompts x {args.tokens} "
            f"tokens per round, {args.rounds} rounds (alternating order, each round its own prompts); medians over "
            "rounds; d and verify in plain decode steps of the same round; reach by depth and per-token acceptance by depth "
            "from the last round. Acceptance = accepted / drafted; per-token acceptance = accepted / judged (a drafted "
            "token is judged when its prefix was kept).\n\n"
            + md_table(rows, cols))
    print(write_results("draft-cost", {"args": vars(args), "rounds": per, "summary": rows}, body, dtype="gguf"))


if __name__ == "__main__":
    main()
