"""How far ahead the x86 kernels should prefetch weights, and from how many rows weight rows go in groups: the
1.5B's forward at 1..9 rows per setting.

The products ask for the weight lines a set distance ahead of the block they read (csrc/arch/x86/x86.h
`stream_ahead`), one distance for a one-row call (decode) and one for more rows (verification, prefill).
Prefetching changes no result, only speed, and the best distance depends on the machine and on how
compute-bound the product is, so this times whole forwards of the default target (128 cached tokens,
every row's logits, as `specfleet.bench.gguf_micro.verify_costs` does) under each setting in one process:
settings alternate in every round (in reversed order every other round), so drift on a shared machine
falls on all of them alike, and each figure is the median over rounds.

    .venv/bin/python benchmarks/kernels/prefetch.py                              # the path's default vs others
    .venv/bin/python benchmarks/kernels/prefetch.py --settings 4096,4096 4096,16384 --rounds 10
    SPECFLEET_ISA=avx2 .venv/bin/python benchmarks/kernels/prefetch.py          # another ISA path

A setting is ONE_ROW,MANY_ROWS in bytes (`specfleet_set_prefetch`), optionally ,GROUP: the fewest activation
rows for which weight rows go in pairs and fours (`specfleet_set_grouping`; fewer go row by row). Or keys, any of
one=, many=, grouped= (the distance for weight rows in pairs and fours), l2= (1: more rows prefetch into L2),
group= and act= (the activation bytes above which 2 or more rows go in groups; 0: never), far= and farmany= (a
second prefetch into L2 only, further ahead, for one row and for more: `specfleet_set_prefetch_far`; 0: none),
chunk= (the fewest bytes of weight rows a one-row product hands a thread at once: `specfleet_set_chunk_bytes`; 0: 64
rows), sched= (1: threads take chunks in guided runs, 0: one at a time, 2: guided, but a fused product over few rows gives
each thread one run of equal bytes: `specfleet_set_schedule`); what a setting
leaves out is the setting in effect, printed.

    .venv/bin/python benchmarks/kernels/prefetch.py --settings 4096,4096,2 4096,4096,6 4096,16384,2   # Zen 4
    .venv/bin/python benchmarks/kernels/prefetch.py --model qwen-0.5b --quantization q4_0 --settings chunk=0 chunk=262144
    .venv/bin/python benchmarks/kernels/prefetch.py --settings l2=0,grouped=4096,act=0 l2=1,grouped=16384,act=16384
"""
from __future__ import annotations

import argparse
import statistics
import time

from specfleet.bench.gguf_micro import CONTEXT, _run, _tokens
from specfleet.bench.report import md_table, write_results
from specfleet.runtime.backends.native import kernels as native_backend

ROWS = (1, 2, 3, 5, 6, 7, 9)  # 6-7: a tree of 5-6 nodes and its root, the one-stream fleet's usual verification
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 12


KEYS = ("one", "many", "grouped", "l2", "group", "act", "far", "farmany", "chunk", "sched")


def setting(text: str) -> dict:
    """ONE,MANY[,GROUP] or key=value pairs (KEYS) -> {key: value} of what the setting fixes"""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        if parts and all("=" in p for p in parts):
            out = {k.strip(): int(v) for k, v in (p.split("=", 1) for p in parts)}
        else:
            values = [int(v) for v in parts]
            if len(values) not in (2, 3):
                raise ValueError
            out = dict(zip(("one", "many", "group"), values))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a setting is ONE_ROW,MANY_ROWS[,GROUP_ROWS] or keys {KEYS}: {text}") from None
    if set(out) - set(KEYS):
        raise argparse.ArgumentTypeError(f"unknown keys {sorted(set(out) - set(KEYS))} in {text} (known: {KEYS})")
    if any(not 0 <= out[k] <= 1 << 20 for k in ("one", "many", "grouped", "far", "farmany") if k in out):
        raise argparse.ArgumentTypeError(f"prefetch distances must lie in [0, {1 << 20}] bytes: {text}")
    if not 0 <= out.get("chunk", 0) <= 1 << 24:
        raise argparse.ArgumentTypeError(f"chunk must lie in [0, {1 << 24}] bytes: {text}")
    if out.get("sched", 0) not in (0, 1, 2):
        raise argparse.ArgumentTypeError(
            f"sched is 0 (one chunk at a time), 1 (guided runs) or 2 (one run a thread for few rows): {text}")
    if (out.get("l2", 0) not in (0, 1) or not 2 <= out.get("group", 2) <= 1 << 20
            or not 0 <= out.get("act", 0) <= 1 << 30):
        raise argparse.ArgumentTypeError(f"l2 is 0 or 1, group in [2, {1 << 20}], act in [0, {1 << 30}]: {text}")
    return out


def full(s: dict, now: dict) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    """a setting with what it leaves out taken from the settings in effect (`native_backend.tuning()`)"""
    pf, far = now["prefetch_bytes"], now["prefetch_far"]
    return (s.get("one", pf[0]), s.get("many", pf[1]), s.get("grouped", pf[2]), s.get("l2", int(now["prefetch_l2"])),
            s.get("group", now["group_min_rows"]), s.get("act", now["group_act_bytes"]), s.get("far", far[0]),
            s.get("farmany", far[1]), s.get("chunk", now["chunk_bytes"]),
            s.get("sched", native_backend.SCHEDULES[now["schedule"]]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", type=setting, nargs="+",
                    default=[{"many": 4096}, {"many": 8192}, {"many": 16384}, {"one": 16384, "many": 16384}],
                    help="ONE_ROW,MANY_ROWS prefetch distances in bytes[,GROUP_ROWS], or keys " + ", ".join(KEYS))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--model", default=None, help="time this model's forward instead of the default target's "
                    "(a registered name or a path)")
    ap.add_argument("--quantization", default="auto",
                    help="its weights' format, as LLM(quantization=...): auto, q4_0, q8_0, q4_k (the draft's q4_0)")
    args = ap.parse_args()
    from specfleet import LLM
    from specfleet.llm import DEFAULT_MODEL

    lib = native_backend.library()
    if lib is None:
        raise SystemExit(f"the native kernels are unavailable here ({native_backend.unavailable_reason()})")
    now = native_backend.tuning()
    args.settings = list(dict.fromkeys(full(s, now) for s in args.settings))
    llm = LLM(args.model or DEFAULT_MODEL, draft="none", quantization=args.quantization)
    engine = llm.engine
    ids = _tokens([llm.tokenizer.encode(PROMPT)], CONTEXT + max(ROWS))
    rid = "__prefetch__"
    engine.blocks.allocate(rid, CONTEXT + max(ROWS))
    times = {(s, n): [] for s in args.settings for n in ROWS}
    try:
        _run(engine, rid, ids[:CONTEXT], 0, False)
        for r in range(args.rounds):
            for s in args.settings if r % 2 == 0 else args.settings[::-1]:
                lib.specfleet_set_prefetch(*s[:4])
                lib.specfleet_set_grouping(*s[4:6])
                lib.specfleet_set_prefetch_far(*s[6:8])
                lib.specfleet_set_chunk_bytes(s[8])
                lib.specfleet_set_schedule(s[9])
                for _ in range(2):  # the steady state of decoding under this setting
                    _run(engine, rid, ids[CONTEXT:CONTEXT + 1], CONTEXT, True)
                for n in ROWS:
                    times[(s, n)].append(_run(engine, rid, ids[CONTEXT:CONTEXT + n], CONTEXT, True))
    finally:
        engine.blocks.free(rid)
    table = []
    for s in args.settings:
        med = {n: statistics.median(times[(s, n)]) for n in ROWS}
        table.append({"one_row_bytes": s[0], "many_rows_bytes": s[1], "grouped_bytes": s[2], "into_l2": s[3],
                      "group_rows": s[4], "group_act_bytes": s[5], "far_one_row_bytes": s[6],
                      "far_many_rows_bytes": s[7], "one_row_chunk_bytes": s[8], "guided": s[9],
                      **{f"ms_{n}": 1e3 * med[n] for n in ROWS},
                      **{f"c({n - 1})": med[n] / med[1] for n in ROWS[1:]}})
        print("one={},many={},grouped={},l2={},group={},act={},far={},farmany={},chunk={},sched={} ".format(*s)
              + " ".join(f"{n}:{1e3 * med[n]:6.2f} ms" for n in ROWS)
              + "  c: " + " ".join(f"{med[n] / med[1]:.2f}" for n in ROWS[1:]), flush=True)
    cols = ["one_row_bytes", "many_rows_bytes", "grouped_bytes", "into_l2", "group_rows", "group_act_bytes",
            "far_one_row_bytes", "far_many_rows_bytes", "one_row_chunk_bytes", "guided",
            *(f"ms_{n}" for n in ROWS), *(f"c({n - 1})" for n in ROWS[1:])]
    body = (f"{args.model or 'The default target'}'s forward ({CONTEXT} cached tokens, every row's logits) at "
            f"{', '.join(map(str, ROWS))} "
            "rows under each setting (prefetch distances in bytes, into L2, the fewest rows in weight-row groups, "
            "the activation bytes from which 2 rows group, the far distances into L2 for one row and more, the "
            "bytes of a one-row product's chunks, and whether threads take chunks in guided runs), "
            f"kernel ISA path {native_backend.isa()}; settings alternate in every round, medians of {args.rounds} "
            "rounds.\n\n" + md_table(table, cols))
    payload = {"args": {"settings": args.settings, "rounds": args.rounds, "model": args.model or "default",
                        "quantization": args.quantization}, "kernel_isa": native_backend.isa(),
               "rows": ROWS, "times_s": {",".join(map(str, s)): {n: times[(s, n)] for n in ROWS} for s in args.settings},
               "table": table, "timestamp": time.time()}
    print(write_results("prefetch", payload, body, device="cpu", dtype="gguf blocks"))


if __name__ == "__main__":
    main()
