"""Benchmark arithmetic on hand-made timings, system names, presets, roofline bytes and the report text."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from specfleet.bench import metrics
from specfleet.bench.cli import add_bench_parser, build_preset
from specfleet.bench.metrics import RequestRecord, WaveRecord
from specfleet.bench.presets import PRESETS, select_parts
from specfleet.bench.render import render_markdown
from specfleet.bench.roofline import measure_bandwidth, weight_bytes_per_step
from specfleet.bench.runner import evaluate_checks, validate
from specfleet.bench.systems import parse_system
from specfleet.errors import SpecfleetError
from tiny_models import ours_from_hf, tiny_hf_model


def rec(system="s", b=1, pid="p", out=10, lat=2.0, ttft=0.5, **spec):
    return RequestRecord(system, b, pid, 5, out, lat, ttft, **spec)


def test_request_rates():
    r = rec(out=10, lat=2.0)
    assert r.tok_s == 5.0 and r.normalized_latency_s == 0.2
    assert rec(out=0).as_dict()["normalized_latency_s"] != rec(out=0).as_dict()["normalized_latency_s"]  # nan
    assert rec(lat=0.0).tok_s == 0.0


def test_percentile_worked_examples():
    assert metrics.percentile([3, 1, 2, 4], 50) == 2.5
    assert metrics.percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert metrics.percentile([7], 90) == 7 and math.isnan(metrics.percentile([], 50))


def test_summarize_two_waves():
    # batch 2: wave 1 = two requests (10 and 6 tokens) in 4 s, prefill done at 1 s; wave 2 = one
    # request of 8 tokens in 2 s, prefill done at 0.5 s
    reqs = [rec(pid="a", b=2, out=10, lat=4.0, ttft=1.0, steps=4, drafted=12, accepted=6, draft_time_s=1.0,
                verify_time_s=2.0, accepted_at_depth=[3, 2, 1]),
            rec(pid="b", b=2, out=6, lat=3.0, ttft=1.0, steps=3, drafted=9, accepted=2, draft_time_s=0.5,
                verify_time_s=1.5, accepted_at_depth=[2]),
            rec(pid="c", b=2, out=8, lat=2.0, ttft=0.5, steps=7, drafted=0, accepted=0, draft_time_s=0.0,
                verify_time_s=1.0, matches_baseline=True)]
    waves = [WaveRecord("s", 2, 2, 16, 4.0, 1.0), WaveRecord("s", 2, 1, 8, 2.0, 0.5)]
    s = metrics.summarize(reqs, waves)
    assert s["throughput_tok_s"] == 24 / 6.0
    assert s["decode_throughput_tok_s"] == (14 + 7) / (3.0 + 1.5)
    assert s["mean_concurrency"] == 1.5
    assert s["request_tok_s_mean"] == pytest.approx((2.5 + 2.0 + 4.0) / 3)
    assert s["normalized_latency_ms_p50"] == pytest.approx(400.0)  # of 400, 500, 250 ms/token
    assert s["ttft_ms_mean"] == pytest.approx(2500 / 3)
    assert s["steps"] == 14 and s["drafted"] == 21 and s["accepted"] == 8
    assert s["acceptance_rate"] == 8 / 21
    assert s["mean_accepted_length"] == (8 + 14) / 14  # counts the bonus token of every step
    assert s["acceptance_by_position"] == [5 / 14, 2 / 14, 1 / 14]
    assert s["draft_time_share"] == 1.5 / 6.0 and s["goodput_tok_s"] == 24 / 6.0
    assert s["baseline_match_rate"] == 1.0
    assert s["per_token_acceptance"] is None  # these records do not say what was judged


def test_per_token_acceptance_over_the_records_that_report_it():
    reqs = [rec(pid="a", steps=4, drafted=12, accepted=6, judged=9),
            rec(pid="b", steps=3, drafted=9, accepted=2, judged=5),
            rec(pid="c", steps=2, drafted=6, accepted=6)]  # a peer's record: accepted, but not what was judged
    s = metrics.spec_summary(reqs)
    assert s["acceptance_rate"] == 14 / 27 and s["per_token_acceptance"] == 8 / 14


def test_summarize_without_spec_counters():
    s = metrics.summarize([rec(out=4, lat=1.0, ttft=None)], [WaveRecord("s", 1, 1, 4, 1.0, None)])
    assert s["acceptance_rate"] is None and s["mean_accepted_length"] is None and s["goodput_tok_s"] is None
    assert s["ttft_ms_mean"] is None and s["decode_throughput_tok_s"] == 3 / 1.0
    # transformers' assisted first pass already emitted 3 tokens by the first-token time
    s = metrics.summarize([rec(out=9, lat=2.0)], [WaveRecord("s", 1, 1, 9, 2.0, 0.5, num_first_tokens=3)])
    assert s["decode_throughput_tok_s"] == (9 - 3) / 1.5
    plain = metrics.spec_summary([rec(steps=9, drafted=0, accepted=0, verify_time_s=1.0)])
    assert plain["mean_accepted_length"] == 1.0 and plain["acceptance_rate"] is None
    assert plain["strategy_overhead_s"] is None and plain["strategy_overhead_share"] is None
    voted = metrics.spec_summary([rec(steps=4, drafted=8, accepted=4, draft_time_s=1.0, verify_time_s=3.0,
                                      strategy_overhead_s=0.02),
                                  rec(steps=4, drafted=8, accepted=4, draft_time_s=1.0, verify_time_s=3.0,
                                      strategy_overhead_s=0.02)])
    assert voted["strategy_overhead_s"] == pytest.approx(0.04) and voted["strategy_overhead_share"] == pytest.approx(0.005)


def test_speedups_and_roofline():
    rows = [{"system": "ar", "batch_size": 1, "throughput_tok_s": 2.0, "request_tok_s_mean": 2.0,
             "mean_concurrency": 1.0},
            {"system": "spec", "batch_size": 1, "throughput_tok_s": 5.0, "request_tok_s_mean": 4.0,
             "mean_concurrency": 1.0},
            {"system": "spec", "batch_size": 4, "throughput_tok_s": 8.0, "request_tok_s_mean": 2.0,
             "mean_concurrency": 4.0}]
    metrics.add_speedups(rows, "ar")
    assert rows[1]["speedup_throughput"] == 2.5 and rows[1]["speedup_request_tok_s"] == 2.0
    assert rows[2]["speedup_throughput"] is None  # no baseline measured at batch 4
    bound = metrics.roofline_tok_s(10e9, 2_000_000_000)  # 10 GB/s over 2 GB of weights
    assert bound == 5.0
    metrics.add_roofline(rows, bound)
    assert rows[0]["roofline_fraction"] == 0.4 and rows[2]["roofline_tok_s"] == 20.0
    assert metrics.ratio_check(rows, ("spec", 1), ("ar", 1), "throughput_tok_s") == 2.5
    assert metrics.ratio_check(rows, ("spec", 2), ("ar", 1), "throughput_tok_s") is None


def test_weight_bytes_per_step():
    untied = ours_from_hf(tiny_hf_model("qwen2"))  # vocab 97, hidden 64
    total = sum(p.numel() * 4 for p in untied.parameters())
    assert weight_bytes_per_step(untied) == total - 97 * 64 * 4  # the embedding is a lookup
    tied = ours_from_hf(tiny_hf_model("llama"))
    assert weight_bytes_per_step(tied) == sum(p.numel() * 4 for p in tied.parameters())
    hf_tied = tiny_hf_model("llama")
    assert weight_bytes_per_step(hf_tied) == sum(p.numel() * 4 for p in hf_tied.parameters())
    fp32 = weight_bytes_per_step(tied)
    assert weight_bytes_per_step(tied.to(torch.bfloat16)) == fp32 // 2  # .to() converts in place


def test_bandwidth_is_positive():
    assert measure_bandwidth("cpu", num_bytes=8 << 20, repeats=2) > 1e6


def test_parse_system():
    s = parse_system("specfleet:vote(qwen-0.5b,ngram),k=6,width=2")
    assert (s.kind, s.draft, s.options) == ("specfleet", "vote(qwen-0.5b,ngram)", {"k": 6, "width": 2})
    assert parse_system("ar").is_autoregressive and parse_system("specfleet").draft == "none"
    assert parse_system("specfleet:none").is_autoregressive and not parse_system("specfleet:ngram").is_autoregressive
    assert parse_system("specfleet:/m/x@12,pipeline=True").options == {"pipeline": True}
    assert parse_system("hf-assisted:qwen-0.5b,k=4").options == {"k": 4}
    assert parse_system("transformers").kind == "hf"
    # commas inside a draft's [options] or a call's (arguments) belong to the draft, not the system
    s = parse_system("specfleet:qwen-0.5b[width=2,nodes=12],quantization=int8")
    assert (s.draft, s.options) == ("qwen-0.5b[width=2,nodes=12]", {"quantization": "int8"})
    assert parse_system("specfleet:select[policy=x](a[k=2,width=2],b),k=3").options == {"k": 3}
    for bad in ("vllm", "hf:qwen", "hf-assisted", "hf-assisted:none"):
        with pytest.raises(SpecfleetError):
            parse_system(bad)


def test_presets_are_valid():
    for preset in PRESETS.values():
        if all(r.device == "cpu" for r in preset.runs):
            validate(preset)  # (the gpu preset names cuda, which this machine may lack)
        for run in preset.runs:
            [parse_system(s) for s in run.systems]
        names = {r.name for r in preset.runs}
        for c in preset.checks:
            assert c.part in names
            systems = next(r.systems for r in preset.runs if r.name == c.part)
            assert c.a[0] in systems and c.b[0] in systems
    spec = PRESETS["spec"]
    assert spec.runs[0].num_prompts == 20 and spec.runs[0].max_tokens == 64 and spec.runs[0].dtype == "bfloat16"
    assert spec.runs[1].batch_sizes == (4, 16)
    with pytest.raises(SpecfleetError, match="no part"):
        select_parts(spec, ["nope"])
    one = select_parts(spec, ["batched"])  # one part: its own claims only
    assert [r.name for r in one.runs] == ["batched"] and one.checks and {c.part for c in one.checks} == {"batched"}


def test_cli_overrides_every_part():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "spec", "--num-prompts", "2", "--max-tokens", "8", "--batch-sizes", "1,2",
                              "--parts", "batched"])
    preset = build_preset(args)
    assert [r.name for r in preset.runs] == ["batched"]
    r = preset.runs[0]
    assert (r.num_prompts, r.max_tokens, r.batch_sizes, r.model) == (2, 8, (1, 2), PRESETS["spec"].runs[1].model)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--batch-sizes", "1,x"])


def test_checks_and_markdown():
    part = {"name": "p", "config": {"model": "m", "dtype": "bfloat16", "device": "cpu", "temperature": 0.0,
                                    "top_k": 0, "top_p": 1.0, "seed": 0, "shuffle_seed": None, "dataset": "humaneval",
                                    "max_tokens": 8, "ignore_eos": False, "batch_sizes": [1], "spec_len": 4},
            "chat_template": False, "baseline": "ar", "roofline_tok_s": 5.0, "weight_bytes_per_step": 2e9,
            "prompts": [{"id": "a", "prompt_tokens": 3}], "skipped": [], "requests": [],
            "systems": [{"label": "ar", "settings": {}}, {"label": "spec", "settings": {"k": 4}}],
            "summaries": [{"system": "ar", "batch_size": 1, "throughput_tok_s": 2.0},
                          {"system": "spec", "batch_size": 1, "throughput_tok_s": 3.0, "draft_time_s": 1.0,
                           "verify_time_s": 2.0}]}
    preset = PRESETS["spec"].__class__("x", "desc", (), (
        PRESETS["spec"].checks[0].__class__("spec beats ar", "p", ("spec", 1), ("ar", 1), "throughput_tok_s", 1.2),
        PRESETS["spec"].checks[0].__class__("missing", "p", ("zz", 1), ("ar", 1), "throughput_tok_s", 1.0)))
    checks = evaluate_checks(preset, [part])
    assert checks[0]["ratio"] == 1.5 and checks[0]["passed"] is True and checks[1]["passed"] is None
    md = render_markdown({"description": "desc", "bandwidth_bytes_s": {"cpu": 1e10}, "checks": checks,
                          "parts": [part]}, {})
    assert "**PASS** spec beats ar: 1.50x" in md and "not measured" in md
    assert "10.0 GB/s" in md and "at most 5.00 tok/s" in md and "| spec | 1 | 3.000 |" in md


def test_micro_figures_and_value_checks():
    """The gguf preset's issue-29 checks: prefill as a ratio of two systems' micro medians, c(k) as a value that
    must stay at most a target (a failing one fails)."""
    from specfleet.bench.presets import Check

    part = {"name": "g", "summaries": [], "systems": [
        {"label": "specfleet:none", "micro": [{"prefill_128_tok_s": 100.0, "c(2)": 1.2, "c(4)": 1.7},
                                              {"prefill_128_tok_s": 120.0, "c(2)": 1.3, "c(4)": 1.5},
                                              {"prefill_128_tok_s": 110.0, "c(2)": 1.1, "c(4)": 1.9}]},
        {"label": "llamacpp", "micro": [{"prefill_128_tok_s": 100.0}, {"prefill_128_tok_s": 100.0}]}]}
    nat = ("specfleet:none", 1)
    preset = PRESETS["spec"].__class__("x", "desc", (), (
        Check("prefill", "g", nat, ("llamacpp", 1), "micro:prefill_128_tok_s", 0.9),
        Check("c2", "g", nat, nat, "micro:c(2)", 0.0, at_most=1.25),
        Check("c4", "g", nat, nat, "micro:c(4)", 0.0, at_most=1.6),
        Check("c8", "g", nat, nat, "micro:c(8)", 0.0, at_most=3.0)))
    prefill, c2, c4, c8 = evaluate_checks(preset, [part])
    assert prefill["ratio"] == 1.1 and prefill["passed"] is True
    assert c2["value"] == 1.2 and c2["passed"] is True
    assert c4["value"] == 1.7 and c4["passed"] is False
    assert c8["value"] is None and c8["passed"] is None
    md = "\n".join(render_markdown({"description": "d", "bandwidth_bytes_s": {}, "checks": [c2, c4], "parts": []},
                                   {}).splitlines())
    assert "**PASS** c2: 1.20 (target <= 1.25)" in md and "**FAIL** c4: 1.70 (target <= 1.6)" in md
    gguf = {c.label: c for c in PRESETS["gguf"].checks}
    assert sum(c.metric == "decode_throughput_tok_s" and c.min_ratio == 1.0 for c in gguf.values()) == 4
    c4 = next(c for c in gguf.values() if c.metric == "micro:c(4)")
    assert c4.at_most == (1.2 if "VNNI" in c4.label else 1.6)  # the VNNI paths are held tighter
    assert {c.metric: c.at_most for c in gguf.values() if c.metric.startswith("micro:c(")} == \
        {"micro:c(2)": 1.25, "micro:c(4)": c4.at_most, "micro:c(8)": 2.2}


def test_overrides_that_no_part_can_run_fail_before_anything_runs():
    """--systems applies to every part: llama.cpp (greedy only) in a sampled part is refused up front, not
    after the greedy parts have run for half an hour."""
    from dataclasses import replace

    preset = PRESETS["fleet"]
    sampled = [r for r in preset.runs if r.temperature != 0]
    assert sampled, "the fleet preset has sampled parts"
    runs = [replace(r, systems=("specfleet:none", "llamacpp")) for r in preset.runs]
    with pytest.raises(SpecfleetError, match=f"part {sampled[0].name}: the llama.cpp system is measured greedy only"):
        validate(replace(preset, runs=runs))
    validate(replace(preset, runs=[r for r in runs if r.temperature == 0]))


def test_the_fleet_preset_measures_the_default_cpu_draft():
    from specfleet.bench.presets import FLEET
    from specfleet.llm import DEFAULT_DRAFT

    assert FLEET == DEFAULT_DRAFT["cpu"]
    for run in PRESETS["fleet"].runs:
        if run.name != "humaneval-cross":
            assert f"specfleet:{FLEET}" in run.systems
