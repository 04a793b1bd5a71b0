"""Prefill and decode speed of the native 1.5B from whatever specfleet is first on the path, for A/B runs
between two checkouts (alternate them: PYTHONPATH=OLD python benchmarks/bench_ab_step.py; PYTHONPATH=NEW ...).
Prints one JSON line: a 500-token prefill (tok/s) and the mean decode tok/s of 3 HumanEval prompts x 48 tokens."""
import sys, time, json, torch, specfleet
torch.set_num_threads(2)
from specfleet import LLM, SamplingParams
llm = LLM("qwen-1.5b", None)
from specfleet.bench.datasets import iter_prompts, select
ps, _ = iter_prompts("humaneval")
prompts = [llm.encode(p.text) for p in select(ps, 3)]
long = (prompts[0] * 20)[:500]
llm.generate([long[:64]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
res = {}
t = time.perf_counter(); llm.generate([long], SamplingParams(temperature=0, max_tokens=1)); res["prefill500_tok_s"] = 500 / (time.perf_counter() - t)
dec = []
for p in prompts:
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
    dec.append(47 / (o.metrics["latency_s"] - o.metrics["ttft_s"]))
res["decode_tok_s"] = sum(dec) / len(dec)
print(json.dumps({"src": specfleet.__file__, **{k: round(v, 2) for k, v in res.items()}}))
