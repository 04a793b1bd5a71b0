"""A/B of two checkouts of specfleet on the CPU: plain decoding and a draft, batch 1, alternating rounds.

    python benchmarks/compare.py --old 16baaf4 [--new HEAD] [--rounds 6] [--draft "fleet(suffix,prompt-lookup)"]

Each ref is checked out into a temporary git worktree (a path is used as it is); every measurement runs in
its own process with PYTHONPATH set to that tree, rounds alternate which tree goes first. A measurement is
the 1.5B GGUF (native kernels) generating 64 greedy tokens for each of 6 HumanEval prompts, one at a time
(prefill included), with the engine's counts: target steps, drafted and accepted tokens, drafting and
verification seconds, and a hash of the tokens (equal hashes: token-identical outputs). Writes
benchmarks/results/ab-trees-cpu-<stamp>.json/.md with every round and the per-round ratios new/old."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(draft: str, prompts: int, tokens: int) -> dict:
    from specfleet.bench.datasets import iter_prompts, select
    from specfleet.llm import LLM
    from specfleet.sampling_params import SamplingParams

    src, _ = iter_prompts("humaneval")
    texts = [p.text for p in select(src, prompts)]
    llm = LLM("qwen-1.5b", draft=None if draft == "none" else draft)
    ids = [llm.tokenizer.encode(t) for t in texts]
    llm.generate(ids[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    s = llm.engine.stats
    before = (s.num_steps, s.num_drafted, s.num_accepted, s.draft_time, s.verify_time)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    toks, wall = [], 0.0
    for p in ids:
        t0 = time.perf_counter()
        toks.append(llm.generate([p], params)[0].token_ids)
        wall += time.perf_counter() - t0
    after = (s.num_steps, s.num_drafted, s.num_accepted, s.draft_time, s.verify_time)
    steps, drafted, accepted, draft_s, verify_s = (a - b for a, b in zip(after, before))
    return {"tok_s": round(sum(map(len, toks)) / wall, 3), "wall_s": round(wall, 3), "steps": steps,
            "drafted": drafted, "accepted": accepted, "draft_s": round(draft_s, 3), "verify_s": round(verify_s, 3),
            "hash": hashlib.sha1(json.dumps(toks).encode()).hexdigest()[:12]}


def tree_of(ref: str, tmp: Path) -> tuple[Path, str]:
    """(checkout, label): a directory as it is, a git ref as a new worktree under tmp."""
    if Path(ref).is_dir():
        return Path(ref).resolve(), ref
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", ref], text=True).strip()
    path = tmp / sha
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), sha], check=True,
                   capture_output=True)
    return path, sha


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="git ref or checkout path of the baseline")
    ap.add_argument("--new", default="HEAD", help="git ref or checkout path (default HEAD)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--draft", default="fleet(suffix,prompt-lookup)", help='the draft beside plain ("none" skips it)')
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.draft, args.prompts, args.tokens)))
        return
    from specfleet.bench.report import md_table, write_results

    drafts = ["none"] + ([args.draft] if args.draft != "none" else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="ab-trees-") as tmp:
        trees = [tree_of(args.new, Path(tmp)), tree_of(args.old, Path(tmp))]
        try:
            for r in range(1, args.rounds + 1):
                for path, label in (trees if r % 2 else trees[::-1]):
                    for draft in drafts:
                        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--draft", draft,
                               "--prompts", str(args.prompts), "--tokens", str(args.tokens)]
                        out = subprocess.run(cmd, cwd=path, env={**os.environ, "PYTHONPATH": str(path)},
                                             capture_output=True, text=True, check=True).stdout
                        res = json.loads(out.strip().splitlines()[-1])
                        rows.append({"round": r, "tree": label, "draft": draft, **res})
                        print(json.dumps(rows[-1]), flush=True)
        finally:
            for path, _ in trees:
                if path.is_relative_to(Path(tmp)):
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                                   capture_output=True)
    summary = summarize(rows, trees[0][1], trees[1][1], drafts, args)
    write_results("ab-trees", summary, report(rows, summary, args, md_table), dtype="gguf")


def summarize(rows, new, old, drafts, args) -> dict:
    ratios = {d: [next(x["tok_s"] for x in rows if x["round"] == r and x["tree"] == new and x["draft"] == d) /
                  next(x["tok_s"] for x in rows if x["round"] == r and x["tree"] == old and x["draft"] == d)
                  for r in range(1, args.rounds + 1)] for d in drafts}
    return {"new": new, "old": old, "rounds": rows, "ratio_new_over_old": ratios,
            "identical_outputs": len({x["hash"] for x in rows}) == 1,
            "means": {f"{t} {d}": statistics.mean(x["tok_s"] for x in rows if x["tree"] == t and x["draft"] == d)
                      for t in (new, old) for d in drafts}}


def report(rows, s: dict, args, md_table) -> str:
    new, old, drafts = s["new"], s["old"], list(s["ratio_new_over_old"])
    lines = [f"A/B of {new} (new) against {old} (old): the 1.5B GGUF, {args.prompts} HumanEval prompts one at a time, "
             f"{args.tokens} greedy tokens, {args.rounds} rounds alternating which tree goes first; drafts: "
             f"{', '.join(drafts)}. Outputs token-identical across every run: **{s['identical_outputs']}**.", ""]
    lines.append(md_table(rows, ["round", "tree", "draft", "tok_s", "steps", "drafted", "accepted", "draft_s",
                                 "verify_s", "hash"]))
    lines += ["", "| draft | new/old per round | mean | rounds new faster |", "|---|---|---|---|"]
    for d, rs in s["ratio_new_over_old"].items():
        lines.append(f"| {d} | {' '.join(f'{x:.3f}' for x in rs)} | {statistics.mean(rs):.3f} | "
                     f"{sum(x > 1 for x in rs)}/{len(rs)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
