"""Overhead of the strategies' own decisions (voting, weight updates, length fitting, matching and
selector bookkeeping) as a share of the run. A benchmark, not a timed unit test: it prints the
figures (run with -s) and asserts only that every part is measured.

On tiny models a step takes about a millisecond, so these shares are far above what the same
microseconds are against a real target's step. SPECFLEET_BENCH_STRATEGIES=1 also runs the embedded
Qwen family (qwen-1.5b target) on CPU, which takes minutes.
"""
import os
import time

import pytest

from specfleet.sampling_params import SamplingParams
from specfleet.core.proposer import describe, total_overhead
from tiny_engines import make_engine, repetitive_prompts
from tests.strategies.test_in_engine import build_strategy
from tiny_models import ours_from_hf, perturbed_copy, run_to_completion, tiny_hf_model

SPEC = "select[exploration_steps=4,chunk_steps=2](vote(d1,d2,prompt-lookup),d1,prompt-lookup)+adaptive"
REAL_SPEC = "select(vote(qwen-0.5b,qwen-0.5b@12,prompt-lookup),qwen-0.5b,prompt-lookup)+adaptive"


def report(label, proposer, wall):
    parts = {f"{name}.{k}": v for name, info in describe(proposer).items() for k, v in info.get("overhead_s", {}).items()}
    total = total_overhead(proposer)
    print(f"\n{label}: run {wall:.3f}s, strategy overhead {total * 1e3:.2f} ms = {100 * total / wall:.2f}%")
    for k, v in parts.items():
        print(f"  {k:70s} {v * 1e3:8.3f} ms")
    return parts


def test_overheads_are_measured_on_tiny_models():
    target = ours_from_hf(tiny_hf_model("qwen2"))
    drafts = {"d1": perturbed_copy(target, 0.15), "d2": perturbed_copy(target, 0.3, seed=1)}
    proposer = build_strategy(SPEC, drafts)
    eng = make_engine(target, proposer)
    t0 = time.perf_counter()
    run_to_completion(eng, repetitive_prompts([5, 17, 9, 30, 3, 12, 8, 21]),
                      SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    parts = report("tiny models, batch 8", proposer, time.perf_counter() - t0)
    assert all(v > 0 for k, v in parts.items() if not k.endswith("matching")), parts
    assert any(k.endswith("vote") for k in parts) and any(k.endswith("fit") for k in parts)


@pytest.mark.skipif(os.environ.get("SPECFLEET_BENCH_STRATEGIES") != "1", reason="set SPECFLEET_BENCH_STRATEGIES=1")
def test_overheads_on_the_embedded_qwen_family():
    from tests.conftest import real_model_path
    from specfleet.llm import LLM

    real_model_path("qwen-1.5b")
    real_model_path("qwen-0.5b")
    llm = LLM("qwen-1.5b", REAL_SPEC, dtype="bfloat16")
    prompts = ["Write a Python function that returns the n-th Fibonacci number.",
               "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n"]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    report("qwen-1.5b with " + REAL_SPEC, llm.engine.proposer, time.perf_counter() - t0)
