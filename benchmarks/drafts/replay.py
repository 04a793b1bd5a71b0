"""Replay the target's greedy outputs to compare weightless drafting policies in seconds, not hours.

A greedy output is fixed by the prompt, so a draft's accepted length at every position can be found
without the target: verification of a point-mass tree keeps the longest path that spells the next
tokens of the output. This harness

1. decodes the benchmark prompts once with the native target (greedy, `--tokens` new tokens) and keeps
   the outputs in a cache file (later runs reuse it);
2. measures the target's forward time for 1..9 rows on this machine (c(n), n draft nodes, as the gguf
   preset does: bench/gguf_micro.py), or takes `--c` from the command line;
3. replays every draft spec over the outputs through the proposer protocol (propose, then feedback
   with the nodes the output confirms, as the engine gives it), on a clock that runs in real time
   while drafts propose and jumps by c(nodes) plain steps for each verification, so a fleet's own
   cost fits see the same costs it would see in a real run.

It prints per spec: tokens per step, nodes verified per step, drafting seconds, and the simulated
speed-up over plain decoding = tokens / (sum of c(nodes) + drafting time in plain steps); prompt
prefill is left out (speculation does not change it). A draft model in a spec runs its real forwards
(its time is drafting time), so it replays too, only not in seconds. Each `--oracle` list is also
replayed as a ceiling: every step all of its drafts propose and only the longest path the output
confirms is verified, at c(that length), which no policy over those drafts can beat.

    python benchmarks/drafts/replay.py [--parts humaneval sharegpt] [--prompts 10] [--tokens 96]
        [--drafts suffix prompt-lookup "fleet(suffix,prompt-lookup,ngram)"] [--c 1,1.29,1.48,...]
        [--oracle suffix,prompt-lookup,ngram]

Writes its figures under benchmarks/results/ (JSON and a Markdown summary).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

TARGET = "qwen2.5-coder-1.5b-instruct"
CACHE = Path.home() / ".cache" / "specfleet" / "replay"


class ReplayRequest:
    """A request view over a fixed output: the proposer sees the prompt and the tokens committed so far."""

    def __init__(self, rid: str, prompt: list[int], max_tokens: int):
        from specfleet.sampling_params import SamplingParams

        self.request_id, self.prompt_token_ids = rid, list(prompt)
        self.tokens = list(prompt)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class ReplayClock:
    """Real time plus the simulated verification time added so far."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.offset


def prompts_for(part: str, num: int, tokenizer) -> list[list[int]]:
    from specfleet.bench import datasets
    from specfleet.bench.runner import encode_prompt

    it, chat = datasets.iter_prompts(part)
    return [encode_prompt(p, tokenizer, chat) for p in datasets.select(it, num)]


def greedy_outputs(llm, part: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from specfleet import SamplingParams

    key = hashlib.sha256(json.dumps([TARGET, part, prompts, tokens]).encode()).hexdigest()[:16]
    path = CACHE / f"{part}-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = [list(o.token_ids) for o in llm.generate(prompts, params)]
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(outs))
    return outs


def _cost_fn(c: list[float]):
    """c(n) for any n: the table, then its last slope."""
    def cost(nodes: int) -> float:
        if nodes < len(c):
            return c[nodes]
        return c[-1] + (c[-1] - c[-2]) * (nodes - len(c) + 1)
    return cost


def replay(proposer, prompts: list[list[int]], outputs: list[list[int]], c: list[float], step_s: float,
           oracle: list | None = None) -> dict:
    """Drive `proposer` over the outputs; returns tokens, steps, nodes, drafting seconds and the simulated
    speed-up. With `oracle` (a list of proposers; `proposer` is then ignored): every step each of them
    drafts and only the longest path the output confirms is verified, at c(its length): what a policy
    that knew the target's next tokens would get from those drafts, a ceiling for any fleet of them."""
    from specfleet.core.proposer import Feedback
    from specfleet.strategies.costs import matched_nodes

    clock = ReplayClock()
    for p in ([proposer] if oracle is None else oracle):
        for q in _proposers(p):
            if hasattr(q, "clock"):
                q.clock = clock
    cost = _cost_fn(c)
    steps = nodes_total = tokens = 0
    draft_s = verify_units = 0.0
    per_prompt = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        r = ReplayRequest(f"r{i}", prompt, len(out))
        t_prompt = 0.0
        while r.num_tokens - len(prompt) < len(out):
            want = out[r.num_tokens - len(prompt):]
            t0 = time.perf_counter()
            drafts = [(p, p.propose([r]).get(r.request_id)) for p in ([proposer] if oracle is None else oracle)]
            dt = time.perf_counter() - t0
            draft_s += dt
            outcome = []  # (proposer, tree, accepted nodes) per draft
            for p, tree in drafts:
                hit = sorted(matched_nodes(tree, want))[:max(0, len(want) - 1)] if tree is not None and len(tree) else []
                outcome.append((p, tree, hit))
            if oracle is None:
                tree, hit = outcome[0][1], outcome[0][2]
                n = len(tree) if tree is not None else 0
            else:
                tree, hit = max(outcome, key=lambda o: len(o[2]))[1:]
                n = len(hit)
            emitted = ([tree.token_ids[j] for j in hit] if hit else []) + [want[len(hit)]]
            v = cost(n)
            verify_units += v
            t_prompt += v + dt / step_s
            clock.offset += v * step_s
            r.tokens += emitted
            for p, t, h in outcome:
                if t is not None and len(t):
                    p.observe([Feedback(r.request_id, t, h, len(emitted), v * step_s, emitted)])
            steps += 1
            nodes_total += n
            tokens += len(emitted)
        for p in ([proposer] if oracle is None else oracle):
            p.release(r.request_id)
        per_prompt.append(len(out) / t_prompt)
    total = verify_units + draft_s / step_s
    state = proposer.state() if oracle is None and hasattr(proposer, "state") else None
    return {"tokens": tokens, "steps": steps, "tokens_per_step": round(tokens / steps, 4),
            "nodes_per_step": round(nodes_total / steps, 3), "draft_s": round(draft_s, 4),
            "verify_plain_steps": round(verify_units, 2), "speedup": round(tokens / total, 4),
            "speedup_per_prompt": [round(x, 3) for x in per_prompt], "state": state}


def _proposers(p):
    yield p
    for child in getattr(p, "children", []) or []:
        yield from _proposers(child)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["humaneval", "sharegpt"])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--drafts", nargs="+", default=["suffix", "prompt-lookup", "fleet(suffix,prompt-lookup,ngram)"])
    ap.add_argument("--oracle", nargs="*", default=["suffix,prompt-lookup,ngram"],
                    help="comma-separated weightless drafts whose oracle ceiling is also replayed")
    ap.add_argument("--c", default=None, help="c(0), c(1), ... comma-separated (default: measure on this machine)")
    ap.add_argument("--step-ms", type=float, default=None, help="the plain step in ms (with --c)")
    args = ap.parse_args()

    from specfleet import LLM
    from specfleet.bench.gguf_micro import verify_costs
    from specfleet.bench.report import write_results
    from specfleet.strategies.factory import SpecConfig, build_proposer

    llm = LLM(TARGET, draft=None, quantization="gguf", max_num_seqs=1)
    prompts = {part: prompts_for(part, args.prompts, llm.tokenizer) for part in args.parts}
    if args.c:
        c, step_s = [float(x) for x in args.c.split(",")], (args.step_ms or 70.0) / 1e3
    else:  # c(1..8) as the gguf preset measures it, after a 128-token context
        step_s, ck = verify_costs(llm.engine, prompts[args.parts[0]])
        c = [1.0, *ck]
    print("c(n):", ", ".join(f"{x:.2f}" for x in c), f"plain step {step_s * 1e3:.1f} ms")

    def make(spec: str):
        return build_proposer(spec, SpecConfig(), llm.model.config.vocab_size, torch.float32, torch.device("cpu"),
                              quantization="gguf")

    results = {"c": c, "step_s": step_s, "parts": {}}
    runs = [(spec, None) for spec in args.drafts] + [(f"oracle({o})", o.split(",")) for o in args.oracle]
    for part in args.parts:
        outputs = greedy_outputs(llm, part, prompts[part], args.tokens)
        results["parts"][part] = {}
        for spec, members in runs:
            if members is None:
                res = replay(make(spec), prompts[part], outputs, c, step_s)
            else:
                res = replay(None, prompts[part], outputs, c, step_s, oracle=[make(m) for m in members])
            results["parts"][part][spec] = res
            print(f"{part:10s} {spec:45s} tokens/step {res['tokens_per_step']:.3f}  nodes/step "
                  f"{res['nodes_per_step']:.2f}  draft {res['draft_s']:.2f}s  speed-up {res['speedup']:.3f}x")
    print(write_results("replay", results, _summary(results), device="cpu", dtype="gguf blocks (the target)"))


def _summary(results: dict) -> str:
    lines = [f"c(n) = {', '.join(f'{x:.2f}' for x in results['c'])}; plain step {results['step_s'] * 1e3:.1f} ms", "",
             "| part | draft | tokens / step | nodes / step | drafting s | simulated speed-up |", "|---|---|---|---|---|---|"]
    for part, specs in results["parts"].items():
        for spec, r in specs.items():
            lines.append(f"| {part} | {spec} | {r['tokens_per_step']} | {r['nodes_per_step']} | {r['draft_s']} | "
                         f"{r['speedup']}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
