"""Decode-step speed of a native GGUF model (quantization="gguf") on the CPU, A/B interleaved, with
llama.cpp (llama-cpp-python) on the same file as the reference.

Systems, measured in rounds that alternate between them (the machine may be shared, so only figures
from the same rounds compare; medians over rounds are printed with ratios):
- `fused`: this tree's native layer path (runtime/backends/native/forward.py, csrc/q_fused.c);
- `modules`: this tree with `RuntimeConfig(fused_native=False)` (the module-by-module forward);
- `base`: another source tree (`--base-src DIR`, e.g. an earlier commit unpacked with
  `git archive <commit> | tar -x -C DIR`), run in a subprocess with DIR first on PYTHONPATH;
- `llama.cpp`: `Llama.eval` of one token at a time.
On a shared machine compare the best rounds too (the least disturbed ones) and the median of the
per-round ratios. A specfleet step is one `ModelRunner.execute` of one new token after `--context` cached tokens (the
engine's own path: batch building, forward, final norm, head logits), plus the argmax.

    OMP_WAIT_POLICY=passive .venv/bin/python benchmarks/peers/decode_step.py --model qwen-1.5b \\
        --base-src /tmp/base --rounds 5
    ... --breakdown   # also where a fused step's time goes (products, attention, the rest)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time


def specfleet_steps(model_name: str, context: int, steps: int, fused: bool | None, breakdown: bool = False,
                    prefill: int = 0) -> dict:
    """Seconds per decode step (median of `steps`) of a native model; fused None = leave the default.
    With `prefill` > 0: seconds of a forward over a `prefill`-token prompt from an empty cache instead
    (median of `steps`, head over its last row)."""
    import torch

    from specfleet.llm import load_model
    from specfleet.runtime.model import decoder as model_mod
    from specfleet.runtime.model.attention import AttentionBatch, SeqAttention
    from specfleet.runtime.kv.cache import KVCache

    model = _cached_model(model_name, load_model)
    if fused is not None:
        model.set_runtime(dataclasses.replace(model.runtime, fused_native=fused))
    if prefill:
        kv = KVCache.allocate(model.config, prefill // 16 + 2, 16, torch.float32, torch.device("cpu"))
        ids = torch.tensor([(7919 * i) % 30000 + 100 for i in range(prefill)])
        batch = AttentionBatch(torch.arange(prefill), [SeqAttention(prefill, 0, slice(0, prefill))])
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            model.compute_logits(model(ids, torch.arange(prefill), batch, kv)[-1:])
            times.append(time.perf_counter() - t0)
        return {"step_s": statistics.median(times)}
    blocks = (context + steps + 16) // 16 + 1
    kv = KVCache.allocate(model.config, blocks, 16, torch.float32, torch.device("cpu"))
    ids = [(7919 * i) % 30000 + 100 for i in range(context)]
    batch = AttentionBatch(torch.arange(context), [SeqAttention(context, 0, slice(0, context))])
    model(torch.tensor(ids), torch.arange(context), batch, kv)
    timers = _TIMERS
    timers.clear()
    if breakdown:
        _instrument(timers)
    tok, times = 1000, []
    for i in range(steps):
        pos = context + i
        t0 = time.perf_counter()
        batch = AttentionBatch(torch.tensor([pos]), [SeqAttention(1, pos, slice(0, pos + 1))])
        hidden = model(torch.tensor([tok]), torch.tensor([pos]), batch, kv)
        tok = int(model.compute_logits(hidden).argmax())
        times.append(time.perf_counter() - t0)
        if i == 1:
            timers.clear()
    out = {"step_s": statistics.median(times[2:])}
    if breakdown:  # means, so they come with the mean step time
        mean = statistics.mean(times[2:])
        out["breakdown_ms"] = {"step(mean)": round(mean * 1e3, 2),
                               **{k: round(v / (steps - 2) * 1e3, 2) for k, v in timers.items()}}
        out["breakdown_ms"]["rest"] = round(mean * 1e3 - sum(timers.values()) / (steps - 2) * 1e3, 2)
    return out


_MODELS: dict = {}
_TIMERS: dict[str, float] = {}


def _cached_model(name, load_model):
    import torch

    if name not in _MODELS:
        _MODELS[name] = load_model(name, torch.float32, torch.device("cpu"), with_tokenizer=False,
                                   quantization="gguf")[0]
    return _MODELS[name]


def _instrument(timers: dict) -> None:
    """Time the native products (all of them, the head included), the attention and the rest."""
    from specfleet.runtime.model import decoder as model_mod
    from specfleet.runtime.formats import qtensor

    def wrap(mod, name, key):
        orig = getattr(mod, name, None)
        if orig is None or getattr(orig, "_timed", False):
            return

        def timed(*a, **k):
            t0 = time.perf_counter()
            r = orig(*a, **k)
            timers[key] = timers.get(key, 0.0) + time.perf_counter() - t0
            return r

        timed._timed = True
        setattr(mod, name, timed)

    wrap(qtensor, "run_fused", "products")
    wrap(qtensor, "run_qlinear", "products")
    wrap(model_mod, "paged_attention", "attention")


def llamacpp_steps(path: str, context: int, steps: int, threads: int) -> dict:
    import llama_cpp

    llm = _LLAMA.get(path)
    if llm is None:
        llm = _LLAMA[path] = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                                             n_ctx=context + steps + 64, verbose=False)
    llm.reset()
    llm.eval([(7919 * i) % 30000 + 100 for i in range(context)])
    tok, times = 1000, []
    for i in range(steps):
        t0 = time.perf_counter()
        llm.eval([tok])
        times.append(time.perf_counter() - t0)
        tok = 1000 + i
    return {"step_s": statistics.median(times[2:])}


_LLAMA: dict = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen-1.5b")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--base-src", default=None, help="a source tree to compare with, run in a subprocess")
    ap.add_argument("--no-modules", action="store_true", help="leave out the module-by-module path")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--prefill", type=int, default=0, help="time a prompt of this many tokens instead of decode steps "
                    "(--steps forwards each; llama.cpp is left out)")
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP / llama.cpp threads (default: torch's)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.child is not None:  # a subprocess measuring one system once
        print(json.dumps(specfleet_steps(args.model, args.context, args.steps, None, args.breakdown, args.prefill)))
        return
    import torch

    from specfleet.bench.llamacpp import gguf_path
    from specfleet.registry import resolve_model

    results: dict[str, list] = {}
    extra: dict[str, dict] = {}
    for r in range(args.rounds):
        systems = ["fused"] + ([] if args.no_modules else ["modules"]) + (["base"] if args.base_src else []) + (
            [] if args.no_llamacpp or args.prefill else ["llama.cpp"])
        for name in systems:
            if name == "fused":
                res = specfleet_steps(args.model, args.context, args.steps, True, args.breakdown, args.prefill)
            elif name == "modules":
                res = specfleet_steps(args.model, args.context, args.steps, False, args.breakdown, args.prefill)
            elif name == "base":
                env = dict(os.environ, PYTHONPATH=os.path.abspath(args.base_src))
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "1", "--model", args.model,
                                       "--context", str(args.context), "--steps", str(args.steps), "--prefill", str(args.prefill)]
                                      + (["--threads", str(args.threads)] if args.threads else [])
                                      + (["--breakdown"] if args.breakdown else []),
                                      env=env, capture_output=True, text=True, check=True, cwd=args.base_src)
                res = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                try:
                    path = str(gguf_path(args.model))
                except Exception:  # noqa: BLE001 -- a registered name's file
                    path = str(resolve_model(args.model))
                res = llamacpp_steps(path, args.context, args.steps, torch.get_num_threads())
            results.setdefault(name, []).append(res["step_s"])
            if "breakdown_ms" in res:
                extra.setdefault(name, {})
                for k, v in res["breakdown_ms"].items():
                    extra[name].setdefault(k, []).append(v)
            print(f"round {r} {name:10s} {res['step_s'] * 1e3:7.1f} ms/step "
                  + (json.dumps(res.get("breakdown_ms")) if args.breakdown else ""), flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    what = f"prefill of {args.prefill} tokens" if args.prefill else f"decode step, context {args.context}"
    print(f"\n{args.model}, {what}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; medians over {args.rounds} rounds")
    for k, v in med.items():
        line = f"  {k:10s} {v * 1e3:7.1f} ms/step  {max(args.prefill, 1) / v:6.2f} tok/s"
        line += f"  (best round {min(results[k]) * 1e3:.1f} ms)"
        if k != "fused":
            per_round = statistics.median(b / a for a, b in zip(results["fused"], results[k]))
            line += (f"  fused/{k} speed: of medians {v / med['fused']:.3f}x, median per round {per_round:.3f}x, "
                     f"of best rounds {min(results[k]) / min(results['fused']):.3f}x")
        if k in extra:
            line += "  breakdown(ms) " + ", ".join(f"{n} {statistics.median(x):.1f}" for n, x in extra[k].items())
        print(line)


if __name__ == "__main__":
    main()
