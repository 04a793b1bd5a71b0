"""Per-row losslessness on real models and real prompts (specfleet/bench/rowcheck.py), draft by draft.

For every draft spec, the prompts (HumanEval, ShareGPT and chitchat from the bench datasets' shipped
files) run greedy through the engine with every verified row replayed as a plain decode step and
compared bit for bit (logits and the K/V of every layer); the outputs are also compared with plain
greedy decoding of the same prompts. Prompts are dealt round-robin to engine configurations so that
each draft is checked at several batch sizes, with prompts chunked by a small token budget, and under
preemption (a KV cache too small for the batch, so requests are recomputed):

    b1        batch 1
    b3        3 requests at once
    b8        8 requests at once
    chunk     3 at once, max_num_batched_tokens=48 (prompts prefilled in chunks beside verification)
    preempt   8 at once in a KV cache that holds the longest request and a draft tree, 4-token blocks (requests outgrow
              it every few tokens: preemption, recompute, scattered block tables)

    python tools/check_rows.py --model qwen-1.5b --drafts suffix prompt-lookup ngram \
        "fleet(suffix,prompt-lookup)" qwen-0.5b "qwen-0.5b[width=2,nodes=16]" --prompts 8 --tokens 64

Writes benchmarks/results/rowcheck-cpu-<time>.json and .md; exits 1 if any row differs or any output
differs from plain decoding.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

CONFIGS = {
    "b1": dict(batch=1),
    "b3": dict(batch=3),
    "b8": dict(batch=8),
    "chunk": dict(batch=3, max_num_batched_tokens=48),
    "preempt": dict(batch=8, kv_requests=1.0, block_size=4),
}


def load_prompts(tokenizer, datasets: list[str], num: int, max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    from specfleet.bench.datasets import iter_prompts, select

    out = []
    for name in datasets:
        prompts, is_chat = iter_prompts(name, install=False)

        def encode(p):
            if is_chat:
                text = tokenizer.apply_chat_template(p.as_messages(), tokenize=False, add_generation_prompt=True)
                return tokenizer.encode(text, add_special_tokens=False)
            return tokenizer.encode(p.text, add_special_tokens=True)

        chosen = select(prompts, num, keep=lambda p: len(encode(p)) <= max_prompt_tokens)
        out += [(f"{name}:{p.prompt_id}", encode(p)) for p in chosen]
    return out


def make_engine(model, tokenizer, draft: str | None, cfg: dict, max_tokens: int, longest: int):
    from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
    from specfleet.engine.engine import Engine
    from specfleet.runtime.kv.cache import bytes_per_token
    from specfleet.strategies.factory import SpecConfig, build_proposer

    per_request = bytes_per_token(model.config, torch.float32) * (longest + max_tokens + 64)  # a draft tree's room too
    kv_bytes = int(per_request * cfg.get("kv_requests", cfg["batch"] + 1))
    proposer = build_proposer(draft, SpecConfig(), model.config.vocab_size, torch.float32, torch.device("cpu"),
                              quantization="auto", target_tokenizer=tokenizer)
    sched = SchedulerConfig(max_num_seqs=cfg["batch"], max_num_batched_tokens=cfg.get("max_num_batched_tokens", 512),
                            mixed_step_factor=None)
    return Engine(model, tokenizer, EngineConfig(CacheConfig(cfg.get("block_size", 16), kv_bytes), sched), proposer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafts", nargs="+", default=["suffix", "prompt-lookup", "ngram", "fleet(suffix,prompt-lookup)"])
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "sharegpt", "chitchat"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per dataset")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--deal-drafts", action="store_true",
                    help="check each prompt with one draft (dealt round-robin) instead of every draft: many "
                         "prompts in the time of few")
    ap.add_argument("--plain-unchecked", action="store_true",
                    help="run plain decoding for the reference outputs without replaying its rows")
    args = ap.parse_args(argv)

    from specfleet.bench.report import md_table, write_results
    from specfleet.bench.rowcheck import RowReport, check_engine_run
    from specfleet.runtime.loading.load import load_model
    from specfleet.sampling_params import SamplingParams

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, tokenizer = load_model(args.model, torch.float32, torch.device("cpu"), quantization="auto")
    prompts = load_prompts(tokenizer, args.datasets, args.prompts, args.max_prompt_tokens)
    longest = max(len(p) for _, p in prompts)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    print(f"{len(prompts)} prompts, {args.tokens} tokens each; configs {args.configs}", flush=True)

    def run(draft: str | None, subset: list, check: bool = True) -> tuple[dict[str, list[int]], RowReport, dict]:
        outs, report, stats = {}, RowReport(), {"drafted": 0, "accepted": 0, "steps": 0, "preemptions": 0}
        for ci, name in enumerate(args.configs):
            cfg = CONFIGS[name]
            mine = subset[ci::len(args.configs)]
            engine = make_engine(model, tokenizer, draft, cfg, args.tokens, longest)
            for i in range(0, len(mine), cfg["batch"]):
                group = mine[i:i + cfg["batch"]]
                if check:
                    results, rep = check_engine_run(engine, [p for _, p in group], params)
                else:
                    from specfleet.bench.rowcheck import run_unchecked

                    results, rep = run_unchecked(engine, [p for _, p in group], params), RowReport()
                report.merge(rep)
                stats["preemptions"] += sum(o.metrics.get("num_preemptions", 0) for o in results)
                outs.update({pid: o.token_ids for (pid, _), o in zip(group, results)})
            s = engine.stats
            stats["drafted"] += s.num_drafted
            stats["accepted"] += s.num_accepted
            stats["steps"] += s.num_steps
        return outs, report, stats

    rows, total_rows, total_diff, mismatched = [], 0, 0, 0
    t0 = time.time()
    plain, plain_report, _ = run(None, prompts, check=not args.plain_unchecked)
    systems = [("plain", plain_report, {}, plain)]
    print(f"plain: {plain_report.rows_checked} rows, {plain_report.rows_differing} differ ({time.time() - t0:.0f} s)",
          flush=True)
    for di, draft in enumerate(args.drafts):
        t = time.time()
        outs, report, stats = run(draft, prompts[di::len(args.drafts)] if args.deal_drafts else prompts)
        systems.append((draft, report, stats, outs))
        equal = sum(outs[pid] == plain[pid] for pid in outs)
        print(f"{draft}: {report.rows_checked} rows, {report.rows_differing} differ; outputs equal to plain on "
              f"{equal}/{len(outs)}; accepted {stats['accepted']}/{stats['drafted']} ({time.time() - t:.0f} s)",
              flush=True)
    payload = {"model": args.model, "prompts": [pid for pid, _ in prompts], "tokens": args.tokens,
               "configs": {c: CONFIGS[c] for c in args.configs}, "systems": []}
    for name, report, stats, outs in systems:
        equal = sum(outs[pid] == plain[pid] for pid in outs)
        total_rows += report.rows_checked
        total_diff += report.rows_differing
        mismatched += len(outs) - equal
        payload["systems"].append({"draft": name, **report.as_dict(), **stats, "outputs_equal_plain": equal,
                                   "num_prompts": len(outs)})
        rows.append({"draft": name, "rows": report.rows_checked, "differ": report.rows_differing,
                     "tree rows": sum(v for k, v in report.routes.items() if "/tree/" in k),
                     "gathered": sum(v for k, v in report.routes.items() if "/gathered/" in k),
                     "17+ rows": sum(v for k, v in report.routes.items() if "rows=17+" in k and "/node/" in k),
                     "batch 2+": sum(v for k, v in report.routes.items() if "batch=2+" in k),
                     "accepted/drafted": f"{stats.get('accepted', 0)}/{stats.get('drafted', 0)}",
                     "preemptions": stats.get("preemptions", 0),
                     "outputs = plain": f"{equal}/{len(outs)}"})
    body = (f"Target `{args.model}`, {len(prompts)} prompts ({', '.join(args.datasets)}, {args.prompts} each), "
            f"{args.tokens} greedy tokens, configs {', '.join(args.configs)} (prompts dealt round-robin), "
            f"each row replayed as a decode step of batch one"
            + ("; each prompt checked with one draft, dealt round-robin" if args.deal_drafts else "")
            + ("; plain decoding's rows not replayed (its outputs are the reference)" if args.plain_unchecked else "")
            + ".\n\n"
            + md_table(rows, list(rows[0])) +
            f"\n\nAll systems: {total_rows} rows checked, **{total_diff} differing**; outputs differing from plain "
            f"decoding: **{mismatched}**.\n\nRoutes per system (rows checked):\n\n"
            + "\n".join(f"- {r['draft']}: " + ", ".join(f"`{k}` {v}" for k, v in r["routes"].items())
                        for r in payload["systems"]))
    path = write_results("rowcheck", payload, body, device="cpu", dtype="gguf blocks")
    print(body)
    print(path)
    return 1 if total_diff or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
