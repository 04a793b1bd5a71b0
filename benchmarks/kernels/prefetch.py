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
rows for which weight rows go in pairs and fours (`specfleet_set_grouping`; fewer go row by row; without it the
setting in effect, printed). Printed per setting: the forward's milliseconds at each row count and c(k), the
(k+1)-row forward over the one-row forward.

    .venv/bin/python benchmarks/kernels/prefetch.py --settings 4096,4096,2 4096,4096,6 4096,16384,2   # Zen 4
"""
from __future__ import annotations

import argparse
import statistics
import time

from specfleet.bench.gguf_micro import CONTEXT, _run, _tokens
from specfleet.bench.report import md_table, write_results
from specfleet.runtime.backends.native import kernels as native_backend

ROWS = (1, 2, 3, 5, 9)
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 12


def setting(text: str) -> tuple[int, int, int | None]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (2, 3):
        raise argparse.ArgumentTypeError(f"a setting is ONE_ROW,MANY_ROWS[,GROUP_ROWS]: {text}")
    one, many, group = values[0], values[1], values[2] if len(values) == 3 else None
    if not (0 <= one <= 1 << 20 and 0 <= many <= 1 << 20):
        raise argparse.ArgumentTypeError(f"prefetch distances must lie in [0, {1 << 20}] bytes: {text}")
    if group is not None and not 2 <= group <= 1 << 20:
        raise argparse.ArgumentTypeError(f"the fewest rows in weight-row groups must lie in [2, {1 << 20}]: {text}")
    return one, many, group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", type=setting, nargs="+",
                    default=[(4096, 4096, None), (4096, 8192, None), (4096, 16384, None), (16384, 16384, None)],
                    help="ONE_ROW,MANY_ROWS prefetch distances in bytes[,GROUP_ROWS]")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    from specfleet import LLM

    lib = native_backend.library()
    if lib is None:
        raise SystemExit(f"the native kernels are unavailable here ({native_backend.unavailable_reason()})")
    group_default = native_backend.tuning()["group_min_rows"]
    args.settings = [(one, many, group_default if group is None else group) for one, many, group in args.settings]
    llm = LLM(draft="none")
    engine = llm.engine
    ids = _tokens([llm.tokenizer.encode(PROMPT)], CONTEXT + max(ROWS))
    rid = "__prefetch__"
    engine.blocks.allocate(rid, CONTEXT + max(ROWS))
    times = {(s, n): [] for s in args.settings for n in ROWS}
    try:
        _run(engine, rid, ids[:CONTEXT], 0, False)
        for r in range(args.rounds):
            for s in args.settings if r % 2 == 0 else args.settings[::-1]:
                lib.specfleet_set_prefetch(*s[:2])
                lib.specfleet_set_grouping(s[2])
                for _ in range(2):  # the steady state of decoding under this setting
                    _run(engine, rid, ids[CONTEXT:CONTEXT + 1], CONTEXT, True)
                for n in ROWS:
                    times[(s, n)].append(_run(engine, rid, ids[CONTEXT:CONTEXT + n], CONTEXT, True))
    finally:
        engine.blocks.free(rid)
    table = []
    for s in args.settings:
        med = {n: statistics.median(times[(s, n)]) for n in ROWS}
        table.append({"one_row_bytes": s[0], "many_rows_bytes": s[1], "group_rows": s[2],
                      **{f"ms_{n}": 1e3 * med[n] for n in ROWS},
                      **{f"c({n - 1})": med[n] / med[1] for n in ROWS[1:]}})
        print(f"{s[0]:>7},{s[1]:<7},{s[2]:<3} " + " ".join(f"{n}:{1e3 * med[n]:6.2f} ms" for n in ROWS)
              + "  c: " + " ".join(f"{med[n] / med[1]:.2f}" for n in ROWS[1:]), flush=True)
    cols = ["one_row_bytes", "many_rows_bytes", "group_rows", *(f"ms_{n}" for n in ROWS), *(f"c({n - 1})" for n in ROWS[1:])]
    body = (f"The default target's forward ({CONTEXT} cached tokens, every row's logits) at {', '.join(map(str, ROWS))} "
            f"rows under each setting (prefetch distances in bytes, the fewest rows in weight-row groups), kernel ISA path {native_backend.isa()}; settings alternate in every "
            f"round, medians of {args.rounds} rounds.\n\n" + md_table(table, cols))
    payload = {"args": {"settings": args.settings, "rounds": args.rounds}, "kernel_isa": native_backend.isa(),
               "rows": ROWS, "times_s": {",".join(map(str, s)): {n: times[(s, n)] for n in ROWS} for s in args.settings},
               "table": table, "timestamp": time.time()}
    print(write_results("prefetch", payload, body, device="cpu", dtype="gguf blocks"))


if __name__ == "__main__":
    main()
