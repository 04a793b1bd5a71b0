"""Long prompts (issue 18): short requests and a running stream while a 4,000-token prompt is prefilled,
and prefill throughput from 512 to 8k prompt tokens, on SmolLM2-135M in fp32 with a prompt-lookup draft.

    .venv/bin/python benchmarks/serving/long_prompt.py          # about 5 minutes on 2 free CPU cores

(a) A stream decodes; a long prompt arrives; short requests arrive one after another during its
    prefill. Reports each short request's time to first token against the same prompt's on an idle
    engine, and how many tokens the stream produced while the long prompt was prefilled.
(b) One prompt on an idle engine: prefill tokens/s (prompt tokens / time to first token); see
    prefill_throughput for how several lengths come from one prompt.
Each figure is from one process, side by side, so a shared machine's drift hits them alike.
"""
from __future__ import annotations

import argparse
import time

import torch

from specfleet.bench.report import md_table, write_results
from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.engine.engine import Engine
from specfleet.runtime.loading.load import load_model
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer


def make_engine(model, budget: int, draft: bool, max_num_prefills: int = SchedulerConfig().max_num_prefills,
                mixed_step_factor: float | None = SchedulerConfig().mixed_step_factor) -> Engine:
    config = EngineConfig(CacheConfig(16, 512 << 20),  # 11k tokens of SmolLM2-135M in fp32
                          SchedulerConfig(max_num_batched_tokens=budget, max_num_prefills=max_num_prefills,
                                          mixed_step_factor=mixed_step_factor))
    return Engine(model, None, config, PromptLookupProposer(PromptLookupConfig()) if draft else None)


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft_idle(eng: Engine, prompt: list[int]) -> float:
    """Time to first token of `prompt` alone on `eng`, which is idle and stays so afterwards."""
    req = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return req.first_token_time - req.arrival_time


def shared_prefill(model, args, budget: int, max_num_prefills: int, factor: float | None) -> tuple[list[dict], dict]:
    """(a): a stream decodes, the long prompt arrives, short requests arrive every `--short-every` s.
    The engine has served one 600-token prompt before, as a running server has: its step costs are
    measured (a fresh server measures them on its first long prompt)."""
    shorts = [random_prompt(args.short_tokens, 100 + i) for i in range(args.num_short)]
    eng = make_engine(model, budget, args.draft, max_num_prefills, factor)
    ttft_idle(eng, random_prompt(600, 7))
    idle = [ttft_idle(eng, p) for p in shorts]
    stream = eng.add_request(random_prompt(16, 1), SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True))
    while not stream.output_token_ids:
        eng.step()
    long = eng.add_request(random_prompt(args.long_tokens, 2), SamplingParams(temperature=0, max_tokens=1,
                                                                              ignore_eos=True))
    stream_before, t_long = len(stream.output_token_ids), long.arrival_time
    pending, reqs, steps = list(shorts), [], 0
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    while long.first_token_time is None or any(r.first_token_time is None for r in reqs) or pending:
        if pending and time.perf_counter() - t_long >= len(reqs) * args.short_every:
            reqs.append(eng.add_request(pending.pop(0), params))
        eng.step()
        steps += 1
        if long.first_token_time is not None and stream_before is not None:
            stream_during = len(stream.output_token_ids) - stream_before
            stream_before = None
    long_s = long.first_token_time - t_long
    rows = [{"budget": budget, "max_num_prefills": max_num_prefills, "mixed_step_factor": factor,
             "request": f"short {i}",
             "prompt_tokens": args.short_tokens, "ttft_idle_s": a,
             "ttft_during_long_prefill_s": r.first_token_time - r.arrival_time,
             "ratio": (r.first_token_time - r.arrival_time) / a,
             "answered_before_long_prefill_done": r.first_token_time < long.first_token_time}
            for i, (a, r) in enumerate(zip(idle, reqs))]
    summary = {"budget": budget, "max_num_prefills": max_num_prefills, "mixed_step_factor": factor,
               "long_prompt_tokens": args.long_tokens,
               "long_prefill_s": long_s,
               "engine_steps": steps,
               "stream_tokens_during_long_prefill": stream_during,
               "stream_tok_s_during_long_prefill": stream_during / long_s,
               "max_ttft_ratio": max(r["ratio"] for r in rows)}
    return rows, summary


def prefill_throughput(model, lengths: list[int], budget: int, rounds: int) -> list[dict]:
    """Prefill tok/s at each length, from one prompt of the longest length prefilled `rounds` times.

    Its steps are the chunks of `budget` tokens a shorter prefix would be prefilled in too, so the
    prefill time at length n is the sum of its first ceil(n / budget) step times (a last partial
    chunk is counted as a whole one). Each step's time is its best over the rounds: a shared
    machine's slow moments then hit no length more than another."""
    eng, prompt, best = make_engine(model, budget, draft=False), random_prompt(max(lengths), 0), {}
    for _ in range(rounds):
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        step = 0
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            best[step] = min(best.get(step, float("inf")), time.perf_counter() - t0)
            step += 1
    rows = []
    for n in lengths:
        dt = sum(best[i] for i in range(-(-n // budget)))
        rows.append({"prompt_tokens": n, "prefill_s": dt, "tok_s": n / dt})
        print(f"prefill {n:5d} tokens {dt:7.2f} s  {n / dt:7.1f} tok/s", flush=True)
    for r in rows:
        r["vs_first"] = r["tok_s"] / rows[0]["tok_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--budget", type=int, default=SchedulerConfig().max_num_batched_tokens,
                    help="max_num_batched_tokens (per-step token budget)")
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--short-tokens", type=int, default=4)
    ap.add_argument("--num-short", type=int, default=4, help="short requests in (a); 0 skips (a)")
    ap.add_argument("--short-every", type=float, default=2.0, help="seconds between short arrivals")
    ap.add_argument("--no-draft", dest="draft", action="store_false", help="plain decoding (default: prompt lookup)")
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[512, 2048, 4096, 8191])
    ap.add_argument("--rounds", type=int, default=2, help="(b): prefill rounds; each step's best time counts")
    ap.add_argument("--fcfs-baseline", action="store_true",
                    help="also run (a) with max_num_prefills=1: one prompt in prefill at a time, in arrival order")
    ap.add_argument("--mixed-step-factors", nargs="*", default=["2", "none"],
                    help="mixed_step_factor values to run (a) with, side by side ('none' turns the cap off)")
    ap.add_argument("--shared-budgets", type=int, nargs="*", default=None,
                    help="budgets to run (a) with (default: --budget); a smaller one trades prefill speed for latency")
    ap.add_argument("--quantization", default="auto",
                    help="weights as load_model takes them: auto (a GGUF file's own block formats on the CPU), none (dense fp32), q4_0, ...")
    args = ap.parse_args()
    model, _ = load_model(args.model, torch.float32, torch.device("cpu"), with_tokenizer=False,
                          quantization=args.quantization)
    weights = getattr(model, "quantization", None) or "dense fp32"
    ttft_idle(make_engine(model, args.budget, args.draft), random_prompt(600, 0))  # warm-up: kernels, both paths
    rows_a, summaries = [], []
    factors = [None if f.lower() == "none" else float(f) for f in args.mixed_step_factors]
    runs = [(b, SchedulerConfig().max_num_prefills, f) for b in args.shared_budgets or [args.budget] for f in factors]
    if args.fcfs_baseline:
        runs.append((args.budget, 1, None))
    for budget, max_num_prefills, factor in runs if args.num_short else []:
        rows, summary = shared_prefill(model, args, budget, max_num_prefills, factor)
        for r in rows:
            print(f"budget {budget} factor {factor} {r['request']}: TTFT idle {r['ttft_idle_s']:.3f} s, during the long prefill "
                  f"{r['ttft_during_long_prefill_s']:.3f} s ({r['ratio']:.2f}x)", flush=True)
        print(summary, flush=True)
        rows_a += rows
        summaries.append(summary)
    rows_b = prefill_throughput(model, args.prefill_tokens, args.budget, args.rounds)
    payload = {"args": vars(args), "shared_prefill": {"requests": rows_a, "summaries": summaries},
               "prefill": rows_b}
    body = (f"`{args.model}` ({weights} weights, fp32 activations) on the CPU{', prompt-lookup draft' if args.draft else ''}. If the machine "
            "was shared while this ran, compare figures within this report only (ratios), not across reports.\n\n"
            + (f"(a) A stream decodes; a {args.long_tokens}-token prompt arrives; {args.num_short} short requests "
               f"arrive every {args.short_every} s during its prefill:\n\n"
               + md_table(summaries, ["budget", "max_num_prefills", "mixed_step_factor", "long_prefill_s", "engine_steps",
                                      "stream_tokens_during_long_prefill", "stream_tok_s_during_long_prefill",
                                      "max_ttft_ratio"]) + "\n\n"
               + md_table(rows_a, ["budget", "max_num_prefills", "mixed_step_factor", "request", "prompt_tokens",
                                   "ttft_idle_s", "ttft_during_long_prefill_s", "ratio",
                                   "answered_before_long_prefill_done"]) + "\n\n" if rows_a else "")
            + f"(b) Prefill throughput, one prompt on an idle engine, budget {args.budget}, each step's best of "
            f"{args.rounds} rounds:\n\n"
            + md_table(rows_b, ["prompt_tokens", "prefill_s", "tok_s", "vs_first"]))
    print(write_results("long_prompt", payload, body, device="cpu", dtype="float32" if weights == "dense fp32" else f"{weights} weights, fp32 activations"))


if __name__ == "__main__":
    main()
