"""A/B of two trees of specfleet on the CPU: is a change free of slowdowns, and are its outputs the same?

    python benchmarks/compare.py OLD [NEW] [--model qwen-1.5b] [--draft SPEC ...] [--rounds 6] [--prompts 6]
                                 [--tokens 64] [--prefill 500] [--threads 2] [--omp-wait-policy passive] [--count-calls]
    python benchmarks/compare.py --here [--prefill 500] ...   # one measurement of the specfleet first on the path

OLD and NEW (default HEAD) are git refs, each checked out into a temporary worktree, or checkout paths used as
they are. Every measurement is a fresh process that imports specfleet from one tree (PYTHONPATH), loads the
model, warms up on one prompt, then generates greedy tokens for each of the first N HumanEval prompts one at a
time (prefill included), plain and with each draft. Rounds alternate which tree goes first, so drift on a shared
machine falls on both alike. Per run: tok/s (new tokens over wall time), decode tok/s (the mean over prompts of
(tokens - 1) / (latency - TTFT)), the engine's counts (target steps, drafted and accepted tokens, drafting and
verification seconds), a hash of the tokens (a refactor must not change one), and with --prefill N the prefill
tok/s of an N-token prompt. --count-calls adds, after the timed rounds, one profiled run per tree and draft:
Python function calls per token and the functions whose counts changed most (timing-free evidence).

Writes benchmarks/results/compare-cpu-<UTC stamp>.json/.md with every round, the per-round ratios new/old, the
medians and whether the outputs are identical.

This one tool replaces bench_ab_trees.py (the rounds, engine counts and hashes), bench_revisions.py (the
medians, same-token check and --count-calls) and bench_ab_step.py (prefill and decode tok/s; `--here` prints
its JSON line for whatever specfleet is first on the path). Their defaults, where they differ from these:
bench_revisions.py was `--draft prompt-lookup --draft qwen-0.5b --prompts 3 --tokens 48 --rounds 3
--omp-wait-policy passive`; bench_ab_step.py was `--here --prefill 500 --prompts 3 --tokens 48 --threads 2 --draft none`.
"""
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
DEFAULT_DRAFT = "fleet(suffix,prompt-lookup)"


def child(model: str, draft: str, prompts: int, tokens: int, prefill: int, threads: int | None,
          count_calls: bool) -> dict:
    """One measurement of the specfleet first on the path."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    import specfleet
    from specfleet.bench.datasets import iter_prompts, select
    from specfleet.llm import LLM
    from specfleet.sampling_params import SamplingParams

    src, _ = iter_prompts("humaneval")
    texts = [p.text for p in select(src, prompts)]
    llm = LLM(model, draft=None if draft == "none" else draft)
    ids = [llm.tokenizer.encode(t) for t in texts]
    res: dict = {"src": specfleet.__file__}
    llm.generate(ids[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    if prefill:
        long = (ids[0] * (prefill // max(1, len(ids[0])) + 1))[:prefill]
        llm.generate([long[:64]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        llm.generate([long], SamplingParams(temperature=0, max_tokens=1))
        res[f"prefill{prefill}_tok_s"] = round(prefill / (time.perf_counter() - t0), 2)
    s = llm.engine.stats
    before = (s.num_steps, s.num_drafted, s.num_accepted, s.draft_time, s.verify_time)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    if count_calls:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    toks, wall, decode = [], 0.0, []
    for p in ids:
        t0 = time.perf_counter()
        out = llm.generate([p], params)[0]
        wall += time.perf_counter() - t0
        toks.append(out.token_ids)
        m = out.metrics or {}
        if m.get("latency_s") and m.get("ttft_s") is not None and len(out.token_ids) > 1:
            decode.append((len(out.token_ids) - 1) / (m["latency_s"] - m["ttft_s"]))
    after = (s.num_steps, s.num_drafted, s.num_accepted, s.draft_time, s.verify_time)
    steps, drafted, accepted, draft_s, verify_s = (a - b for a, b in zip(after, before))
    res.update({"tok_s": round(sum(map(len, toks)) / wall, 3), "wall_s": round(wall, 3),
                "tokens": sum(map(len, toks)), "steps": steps, "drafted": drafted, "accepted": accepted,
                "draft_s": round(draft_s, 3), "verify_s": round(verify_s, 3),
                "hash": hashlib.sha1(json.dumps(toks).encode()).hexdigest()[:12]})
    if decode:
        res["decode_tok_s"] = round(statistics.mean(decode), 2)
    if count_calls:
        import pstats
        prof.disable()
        st = pstats.Stats(prof)
        res["calls"] = {f"{f[0].split('/specfleet/')[-1]}:{f[2]}": v[1] for f, v in st.stats.items()}
    return res


def tree_of(ref: str, tmp: Path) -> tuple[Path, str]:
    """(checkout, label): a directory as it is, a git ref as a new worktree under tmp."""
    if Path(ref).is_dir():
        return Path(ref).resolve(), ref
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", ref], text=True).strip()
    path = tmp / sha
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), sha], check=True,
                   capture_output=True)
    return path, sha


def split_specs(text: str) -> list[str]:
    """Comma-separated draft specs, commas inside parentheses kept: "none,fleet(a,b)" -> ["none", "fleet(a,b)"]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += 1 if ch in "([" else -1 if ch in ")]" else 0
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [s.strip() for s in out + [cur] if s.strip()]


def measure(path: Path, args, draft: str, count_calls: bool = False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model, "--draft", draft,
           "--prompts", str(args.prompts), "--tokens", str(args.tokens), "--prefill", str(args.prefill)]
    cmd += ["--threads", str(args.threads)] if args.threads else []
    cmd += ["--count-calls"] if count_calls else []
    env = {**os.environ, "PYTHONPATH": str(path)}
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    proc = subprocess.run(cmd, cwd=path, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{path} ({draft}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", nargs="?", help="git ref or checkout path of the baseline")
    ap.add_argument("new", nargs="?", help="git ref or checkout path (default HEAD)")
    ap.add_argument("--old", dest="old_opt", help="the same as OLD")
    ap.add_argument("--new", dest="new_opt", help="the same as NEW")
    ap.add_argument("--here", action="store_true",
                    help="measure the specfleet first on the path once: one JSON line per draft (no A/B)")
    ap.add_argument("--model", default="qwen-1.5b")
    ap.add_argument("--draft", action="append", default=None,
                    help=f'a draft beside plain, repeatable or comma-separated (default {DEFAULT_DRAFT}; "none": plain only)')
    ap.add_argument("--drafts", help="comma-separated drafts (bench_revisions.py's spelling; plain is always run)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=0, help="also time the prefill of a prompt of this many tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's own)")
    ap.add_argument("--omp-wait-policy", default=None, help="OMP_WAIT_POLICY for the measured processes")
    ap.add_argument("--count-calls", action="store_true",
                    help="after the timed rounds, one profiled run per tree and draft: Python function calls per token")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    specs = split_specs(",".join(args.draft or []) + "," + (args.drafts or "")) or [DEFAULT_DRAFT]
    if args.child:
        print(json.dumps(child(args.model, specs[0], args.prompts, args.tokens, args.prefill, args.threads,
                               args.count_calls)))
        return
    if args.here:
        for d in ["none"] + [s for s in specs if s != "none"]:
            res = child(args.model, d, args.prompts, args.tokens, args.prefill, args.threads, False)
            print(json.dumps({"draft": d, **res}), flush=True)
        return
    old, new = args.old or args.old_opt, args.new or args.new_opt or "HEAD"
    if not old:
        ap.error("OLD (or --old) is required, unless --here")
    sys.path.insert(0, str(ROOT))
    from specfleet.bench.report import md_table, write_results

    drafts = ["none"] + [s for s in specs if s != "none"]
    rows, calls = [], {}
    with tempfile.TemporaryDirectory(prefix="compare-") as tmp:
        trees = [tree_of(new, Path(tmp)), tree_of(old, Path(tmp))]
        try:
            for r in range(1, args.rounds + 1):
                for path, label in (trees if r % 2 else trees[::-1]):
                    for draft in drafts:
                        rows.append({"round": r, "tree": label, "draft": draft, **measure(path, args, draft)})
                        print(json.dumps(rows[-1]), flush=True)
            if args.count_calls:
                calls = {d: {label: measure(path, args, d, True) for path, label in trees} for d in drafts}
        finally:
            for path, _ in trees:
                if path.is_relative_to(Path(tmp)):
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                                   capture_output=True)
    summary = summarize(rows, trees[0][1], trees[1][1], drafts, args, calls)
    body = report(rows, summary, args, md_table)
    print(body)
    print(f"wrote {write_results('compare', summary, body, dtype=f'{args.model} (its stored format)')}")


def summarize(rows, new, old, drafts, args, calls) -> dict:
    def of(tree, d, key="tok_s"):
        return [x[key] for x in rows if x["tree"] == tree and x["draft"] == d]

    ratios = {d: [next(x["tok_s"] for x in rows if x["round"] == r and x["tree"] == new and x["draft"] == d) /
                  next(x["tok_s"] for x in rows if x["round"] == r and x["tree"] == old and x["draft"] == d)
                  for r in range(1, args.rounds + 1)] for d in drafts}
    out = {"new": new, "old": old, "model": args.model, "prompts": args.prompts, "tokens": args.tokens,
           "rounds": rows, "ratio_new_over_old": ratios,
           "identical_outputs": {d: len({x["hash"] for x in rows if x["draft"] == d}) == 1 for d in drafts},
           # greedy speculation is lossless, so plain and every draft give the same tokens too
           "identical_across_drafts": len({x["hash"] for x in rows}) == 1,
           "medians": {d: {t: statistics.median(of(t, d)) for t in (new, old)} for d in drafts},
           "means": {f"{t} {d}": statistics.mean(of(t, d)) for t in (new, old) for d in drafts}}
    for key in ("decode_tok_s", f"prefill{args.prefill}_tok_s"):
        if all(key in x for x in rows):
            out[f"medians_{key}"] = {d: {t: statistics.median(of(t, d, key)) for t in (new, old)} for d in drafts}
    if calls:
        out["calls"] = {}
        for d in drafts:
            per = {t: calls[d][t]["calls"] for t in (new, old)}
            diff = sorted(set(per[new]) | set(per[old]), key=lambda f: -abs(per[new].get(f, 0) - per[old].get(f, 0)))[:8]
            out["calls"][d] = {"per_token": {t: sum(per[t].values()) / calls[d][t]["tokens"] for t in (new, old)},
                               "changed": {f: [per[old].get(f, 0), per[new].get(f, 0)] for f in diff}}
    return out


def report(rows, s: dict, args, md_table) -> str:
    new, old, drafts = s["new"], s["old"], list(s["ratio_new_over_old"])
    lines = [f"A/B of {new} (new) against {old} (old): {args.model}, {args.prompts} HumanEval prompts one at a time, "
             f"{args.tokens} greedy tokens, {args.rounds} rounds alternating which tree goes first; drafts: "
             f"{', '.join(drafts)}. Outputs token-identical across every run, per draft: "
             f"{', '.join(f'{d} **{v}**' for d, v in s['identical_outputs'].items())}; the same across drafts: "
             f"**{s['identical_across_drafts']}**.", ""]
    extra = [k for k in ("decode_tok_s", f"prefill{args.prefill}_tok_s") if all(k in x for x in rows)]
    lines.append(md_table(rows, ["round", "tree", "draft", "tok_s", *extra, "steps", "drafted", "accepted", "draft_s",
                                 "verify_s", "hash"]))
    lines += ["", f"| draft | median new / old tok/s | new/old per round | mean | rounds new faster |",
              "|---|---|---|---|---|"]
    for d, rs in s["ratio_new_over_old"].items():
        m = s["medians"][d]
        lines.append(f"| {d} | {m[new]:.2f} / {m[old]:.2f} | {' '.join(f'{x:.3f}' for x in rs)} | "
                     f"{statistics.mean(rs):.3f} | {sum(x > 1 for x in rs)}/{len(rs)} |")
    if "calls" in s:
        lines += ["", "Python function calls per generated token (one profiled run per tree, not timed): the same work "
                  "per token means a tok/s difference between the trees is the machine's, not the code's.", "",
                  "| draft | old calls/token | new calls/token | new/old | largest changes (old -> new, whole run) |",
                  "|---|---|---|---|---|"]
        for d, c in s["calls"].items():
            pt = c["per_token"]
            changed = "; ".join(f"`{f}` {a} -> {b}" for f, (a, b) in list(c["changed"].items())[:5] if a != b)
            lines.append(f"| {d} | {pt[old]:.0f} | {pt[new]:.0f} | {pt[new] / pt[old]:.3f} | {changed or '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
