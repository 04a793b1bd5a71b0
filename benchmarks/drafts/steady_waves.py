"""Waves of concurrent requests in steady state: each system warms up on prompts of its own first, then timed
waves alternate between the systems, each round on new prompts.

    python benchmarks/drafts/steady_waves.py --model SmolLM2-135M-Instruct.Q4_1.gguf --device cuda --dtype bfloat16 \
        --systems "none;fleet(suffix,prompt-lookup);fleet[price_padded=false](suffix,prompt-lookup)"

What `specfleet bench` measures includes one-off costs that a long-running server pays once: on a GPU the first
step of each step shape captures its CUDA graph (three forwards and the capture; runtime/backends/cuda/graphs.py),
and a fleet at batch 8 meets new shapes for many waves. Here every system first runs `--warmup` waves on other
prompts (so its shapes are captured and its cost models have data), then `--rounds` timed waves of `--batch`
prompts x `--tokens` greedy tokens, the systems' order alternating; the captures made during the timed waves are
printed with each. Every system's output must equal plain decoding's (the first system, `none`). Writes JSON and
Markdown under benchmarks/results/."""
from __future__ import annotations

import argparse
import statistics
import time

from specfleet.bench.report import md_table, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen-1.5b")
    ap.add_argument("--systems", default="none;fleet(suffix,prompt-lookup)", help="';'-separated draft specs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="waves per system before timing, on other prompts")
    ap.add_argument("--dataset", default="humaneval")
    args = ap.parse_args()

    import torch

    from specfleet.bench.datasets import iter_prompts, select
    from specfleet.llm import LLM
    from specfleet.sampling_params import SamplingParams

    specs = [s.strip() for s in args.systems.split(";") if s.strip()]
    if specs[0] != "none":
        specs.insert(0, "none")
    b = args.batch
    src, _ = iter_prompts(args.dataset)
    texts = [p.text for p in select(src, b * (args.rounds + args.warmup))]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    llms = {s: LLM(args.model, draft=s, device=args.device, dtype=args.dtype, max_num_seqs=b) for s in specs}
    for llm in llms.values():
        for w in range(args.warmup):
            llm.generate(texts[b * (args.rounds + w):b * (args.rounds + w + 1)], params)
    rates: dict[str, list[float]] = {s: [] for s in specs}
    outs, rows = {}, []
    for r in range(args.rounds):
        for s in specs if r % 2 == 0 else specs[::-1]:
            llm = llms[s]
            graphs = llm.engine.runner.graphs
            c0 = graphs.captures if graphs is not None else 0
            sync()
            t0 = time.perf_counter()
            got = llm.generate(texts[b * r:b * (r + 1)], params)
            sync()
            dt = time.perf_counter() - t0
            outs[(s, r)] = [o.token_ids for o in got]
            rates[s].append(sum(len(o.token_ids) for o in got) / dt)
            captures = (graphs.captures if graphs is not None else 0) - c0
            print(f"round {r} {s:56s} {rates[s][-1]:8.1f} tok/s  captures {captures}", flush=True)
            rows.append({"round": r, "system": s, "tok/s": round(rates[s][-1], 1), "captures": captures})
    plain = statistics.median(rates["none"])
    summary = [{"system": s, "tok/s (median)": round(statistics.median(rates[s]), 1),
                "x plain": round(statistics.median(rates[s]) / plain, 3),
                "per round x plain": [round(x / y, 3) for x, y in zip(rates[s], rates["none"])],
                "= plain": all(outs[(s, r)] == outs[("none", r)] for r in range(args.rounds))} for s in specs]
    print(md_table(summary, list(summary[0])))
    body = (f"{args.model}, {args.device}, {args.dtype}: waves of {b} {args.dataset} prompts x {args.tokens} greedy "
            f"tokens, {args.warmup} warm-up waves per system on other prompts, {args.rounds} timed rounds in "
            "alternating order, each round new prompts.\n\n" + md_table(summary, list(summary[0]))
            + "\n\n" + md_table(rows, list(rows[0])))
    print(write_results("steady-waves", {"args": vars(args), "rounds": rows, "summary": summary}, body,
                        device=args.device, dtype=args.dtype))


if __name__ == "__main__":
    main()
