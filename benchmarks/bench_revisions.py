"""Two revisions of specfleet side by side in one run: is a change free of slowdowns?

Each revision is checked out into its own git worktree; every measurement is a fresh process that
imports specfleet from one worktree (PYTHONPATH), loads the model, warms up on one prompt, then
times greedy generation of the first N HumanEval prompts one at a time. Rounds alternate the order
of the revisions (A B, B A, ...), so drift on a shared machine falls on both alike. Outputs are
compared too: a refactor must not change a single token.

    python benchmarks/bench_revisions.py BASE [HEAD] [--drafts none,prompt-lookup,qwen-0.5b] [--rounds 3]

Writes benchmarks/results/revisions-cpu-<time>.json and .md (tok/s per revision and draft, the
medians, the HEAD/BASE ratio, whether the outputs match).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from specfleet import LLM, SamplingParams
from specfleet.bench.datasets import iter_prompts, select
model, draft, n, tokens, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
prompts = [p.text for p in select(iter_prompts("humaneval")[0], n)]
llm = LLM(model, None if draft == "none" else draft)
params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
if count:  # Python function calls of the same generation (cProfile), instead of timing it
    import cProfile, pstats
    prof = cProfile.Profile()
    prof.enable()
outs, new, t0 = [], 0, time.perf_counter()
for p in prompts:
    (o,) = llm.generate([p], params)
    outs.append(o.token_ids)
    new += len(o.token_ids)
dt = time.perf_counter() - t0
res = {"tok_s": new / dt, "seconds": dt, "tokens": new, "outputs": outs}
if count:
    prof.disable()
    st = pstats.Stats(prof)
    res["calls"] = {f"{f[0].split('/specfleet/')[-1]}:{f[2]}": v[1] for f, v in st.stats.items()}
print("RESULT " + json.dumps(res))
"""


def worktree(rev: str, where: Path) -> Path:
    path = where / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    return path


def measure(tree: Path, model: str, draft: str, n: int, tokens: int, count_calls: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_WAIT_POLICY="passive")  # fair to whatever else runs
    proc = subprocess.run([sys.executable, "-c", CHILD, model, draft, str(n), str(tokens), str(int(count_calls))], env=env,
                          capture_output=True, text=True, cwd=str(tree))
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{tree} ({draft}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("head", nargs="?", default="HEAD")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafts", default="none,prompt-lookup,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--count-calls", action="store_true",
                    help="after the timed rounds, one profiled run per revision and draft: Python function calls "
                         "per generated token and the functions whose call counts differ most (timing-free evidence)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from specfleet.bench.report import write_results

    revs = {"base": args.base, "head": args.head}
    shas = {k: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", v], capture_output=True, text=True,
                              check=True).stdout.strip() for k, v in revs.items()}
    drafts = args.drafts.split(",")
    runs: dict = {d: {"base": [], "head": []} for d in drafts}
    outputs: dict = {d: {} for d in drafts}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {k: worktree(v, Path(tmp)) for k, v in revs.items()}
        try:
            for r in range(args.rounds):
                order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
                for d in drafts:
                    for k in order:
                        res = measure(trees[k], args.model, d, args.prompts, args.tokens)
                        runs[d][k].append(res["tok_s"])
                        outputs[d][k] = res["outputs"]
                        print(f"round {r + 1} {d:>32} {k} ({shas[k]}): {res['tok_s']:.2f} tok/s", flush=True)
            calls: dict = {d: {k: measure(trees[k], args.model, d, args.prompts, args.tokens, True)
                               for k in revs} for d in drafts} if args.count_calls else {}
        finally:
            for t in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(t)], capture_output=True)
    rows, payload = [], {"base": shas["base"], "head": shas["head"], "model": args.model, "prompts": args.prompts,
                         "tokens": args.tokens, "rounds": args.rounds, "drafts": {}}
    for d in drafts:
        b, h = statistics.median(runs[d]["base"]), statistics.median(runs[d]["head"])
        same = outputs[d]["base"] == outputs[d]["head"]
        payload["drafts"][d] = {"base_tok_s": runs[d]["base"], "head_tok_s": runs[d]["head"], "base_median": b,
                                "head_median": h, "ratio": h / b, "same_outputs": same}
        rows.append(f"| {d} | {b:.2f} | {h:.2f} | {h / b:.3f} | {'yes' if same else 'NO'} |")
    body = (f"{args.model}, greedy, {args.prompts} HumanEval prompts one at a time, {args.tokens} new tokens, "
            f"{args.rounds} rounds in alternating order; medians of tok/s (warm-up excluded).\n\n"
            f"| draft | base {shas['base']} tok/s | head {shas['head']} tok/s | head/base | same tokens |\n"
            f"|---|---|---|---|---|\n" + "\n".join(rows))
    if calls:
        crow = []
        for d in drafts:
            per = {k: calls[d][k]["calls"] for k in revs}
            tot = {k: sum(per[k].values()) / calls[d][k]["tokens"] for k in revs}
            diff = sorted(set(per["base"]) | set(per["head"]),
                          key=lambda f: -abs(per["head"].get(f, 0) - per["base"].get(f, 0)))[:8]
            payload["drafts"][d]["calls_per_token"] = tot
            payload["drafts"][d]["calls_changed"] = {f: [per["base"].get(f, 0), per["head"].get(f, 0)] for f in diff}
            changed = "; ".join(f"`{f}` {per['base'].get(f, 0)} -> {per['head'].get(f, 0)}" for f in diff[:5]
                                if per["base"].get(f, 0) != per["head"].get(f, 0))
            crow.append(f"| {d} | {tot['base']:.0f} | {tot['head']:.0f} | {tot['head'] / tot['base']:.3f} | {changed or '-'} |")
        body += ("\n\nPython function calls per generated token (one profiled run per revision, not timed): the "
                 "same work per token means a tok/s difference between the revisions is the machine's, not the "
                 "code's.\n\n| draft | base calls/token | head calls/token | head/base | largest changes (base -> head, "
                 "whole run) |\n|---|---|---|---|---|\n" + "\n".join(crow))
    print(body)
    path = write_results("revisions", payload, body, "cpu", "auto (native GGUF on CPU)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
