"""The per-system figures of the `gguf` preset beyond end-to-end generation, measured once per system
after its warm-up: prefill tok/s at fixed prompt lengths, the verification cost c(k) and resident memory.

- prefill: seconds to run a prompt of n tokens from an empty cache (specfleet: one forward through
  the engine's runner; llama.cpp: `Llama.eval`), best of `repeats`; tok/s = n / seconds.
- c(k): seconds of one target forward over k+1 new tokens after a 128-token context, divided by the
  seconds of a forward over 1 token at the same context, in steady state (after warm one-token forwards,
  shapes interleaved over rounds, medians; specfleet only; PERFORMANCE.md's cost model).
- rss_mb / peak_rss_mb: this process's resident memory now and its peak so far (VmRSS / VmHWM), which
  covers the target, its drafts and KV caches of the systems built so far in the part.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

PREFILL_LENGTHS = (128, 512)
VERIFY_KS = tuple(range(1, 9))
CONTEXT = 128


def memory_mb() -> dict:
    """VmRSS and VmHWM of this process in MiB (empty where /proc is absent)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = {line.split(":")[0]: line.split()[1] for line in lines if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss_mb": round(int(fields["VmRSS"]) / 1024), "peak_rss_mb": round(int(fields["VmHWM"]) / 1024)}


def _tokens(source: list[list[int]], n: int) -> list[int]:
    """n token ids cut from the prompts laid end to end (repeated if they are shorter)."""
    flat = [t for p in source for t in p] or [0]
    return (flat * (n // len(flat) + 1))[:n]


def measure(system, prompt_ids: list[list[int]], repeats: int = 3) -> dict:
    from specfleet.bench.llamacpp import LlamaCppSystem, LlamaServerSystem
    from specfleet.bench.systems import SpecfleetSystem

    out: dict = {}
    if isinstance(system, SpecfleetSystem) and system.llm.engine.proposer is None:
        engine = system.llm.engine
        for n in PREFILL_LENGTHS:
            s = _best(lambda n=n: _prefill(engine, _tokens(prompt_ids, n)), repeats)
            out[f"prefill_{n}_tok_s"] = round(n / s, 2)
        one, c = verify_costs(engine, prompt_ids, repeats)
        for k, ck in zip(VERIFY_KS, c):
            out[f"c({k})"] = round(ck, 2)
        out["decode_step_ms"] = round(one * 1000, 1)
    elif isinstance(system, (LlamaCppSystem, LlamaServerSystem)):
        for n in PREFILL_LENGTHS:
            s = _best(lambda n=n: system.prefill_seconds(_tokens(prompt_ids, n)), repeats)
            out[f"prefill_{n}_tok_s"] = round(n / s, 2)
    return out | memory_mb()


def verify_costs(engine, prompt_ids: list[list[int]], repeats: int = 3) -> tuple[float, list[float]]:
    """(seconds of a one-token forward after CONTEXT cached tokens, [c(k) for k in VERIFY_KS]) of a
    specfleet engine's target: the forward over k+1 tokens, every row's logits, over the one-token one.

    Steady state, as decoding meets it: the context is computed once and a few one-token forwards run
    before any is timed (the first forwards after a prefill are slower: caches and the allocator still
    hold the prefill's working set); then each round times every shape once, in an order that rotates
    from round to round, so drift on a shared machine falls on all shapes alike. Each shape's time is
    the median over `repeats` + 2 rounds, and c(k) divides medians at the same context."""
    ids = _tokens(prompt_ids, CONTEXT + max(VERIFY_KS) + 1)
    shapes = (1,) + tuple(k + 1 for k in VERIFY_KS)
    times: dict[int, list[float]] = {n: [] for n in shapes}
    rid = "__gguf_micro__"
    engine.blocks.allocate(rid, CONTEXT + max(shapes))
    try:
        _run(engine, rid, ids[:CONTEXT], 0, False)
        for _ in range(4):  # warm: the steady state of decoding, not the first forwards after a prefill
            _run(engine, rid, ids[CONTEXT:CONTEXT + 1], CONTEXT, True)
        for r in range(repeats + 2):
            order = shapes[r % len(shapes):] + shapes[:r % len(shapes)]
            for n in order:
                times[n].append(_run(engine, rid, ids[CONTEXT:CONTEXT + n], CONTEXT, True))
    finally:
        engine.blocks.free(rid)
    med = {n: statistics.median(v) for n, v in times.items()}
    return med[1], [med[k + 1] / med[1] for k in VERIFY_KS]


def _run(engine, rid: str, ids: list[int], context: int, all_rows: bool) -> float:
    """Seconds of one forward of `ids` at positions context.. of request `rid` (its blocks allocated):
    every row's logits (verification) or the last row's (a prefill). Later forwards at the same context
    overwrite the same KV slots, so the cached context stays what it was."""
    from specfleet.runtime.step.runner import ForwardItem

    rows = list(range(len(ids))) if all_rows else [len(ids) - 1]
    t0 = time.perf_counter()
    engine.runner.execute([ForwardItem(rid, ids, context, rows)], engine.blocks)
    return time.perf_counter() - t0


def _best(run, repeats: int) -> float:
    times = sorted(run() for _ in range(repeats))
    return times[0] if len(times) < 3 else statistics.median(times[:3])


def _prefill(engine, ids: list[int]) -> float:
    """Seconds of a prefill of `ids` from an empty cache (the last row's logits); the KV blocks are freed after."""
    rid = "__gguf_micro__"
    engine.blocks.allocate(rid, len(ids))
    try:
        return _run(engine, rid, ids, 0, False)
    finally:
        engine.blocks.free(rid)
