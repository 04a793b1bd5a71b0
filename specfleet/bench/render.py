"""The Markdown body of a benchmark report: roofline line, one table per part, checks, plots."""
from __future__ import annotations

from pathlib import Path

from specfleet.bench.report import md_table

COLUMNS = [
    ("system", "system"), ("batch_size", "batch"), ("throughput_tok_s", "tok/s"),
    ("decode_throughput_tok_s", "decode tok/s"), ("request_tok_s_mean", "req tok/s"),
    ("normalized_latency_ms_p50", "norm. lat. p50 ms/tok"), ("normalized_latency_ms_p90", "p90"),
    ("ttft_ms_mean", "TTFT ms"), ("cached_prompt_share", "prompt cached"), ("acceptance_rate", "accept rate"),
    ("per_token_acceptance", "per-token accept"),
    ("mean_accepted_length", "mean acc. len"),
    ("draft_time_share", "draft share"), ("goodput_tok_s", "goodput tok/s"),
    ("speedup_throughput", "speed-up"), ("roofline_fraction", "of roofline"), ("baseline_match_rate", "= AR out"),
    ("rows_checked", "rows checked"), ("rows_differing", "rows != decode"),
]


def render_markdown(payload: dict, plots: dict[str, list[Path]]) -> str:
    out = [payload["description"], ""]
    if payload.get("expected_duration"):
        out += [f"Expected duration of the preset as defined (options given on the command line change it): "
                f"{payload['expected_duration']}.", ""]
    for device, bw in payload["bandwidth_bytes_s"].items():
        out.append(f"Measured memory bandwidth ({device}, large tensor copy): {bw / 1e9:.1f} GB/s.")
    out += ["", *_checks(payload["checks"])]
    for part in payload["parts"]:
        out += _part(part, plots.get(part["name"], []))
    out += ["## How to read this", "",
            "- tok/s: output tokens of all requests / wall time of all waves (a wave = `batch` prompts "
            "submitted together); decode tok/s leaves each wave's prefill out: it times from the wave's last first "
            "token but counts every token after each request's first, so at batch > 1 a system whose prompts finish "
            "prefilling later (its early requests decoding meanwhile) reads higher there than it is; compare tok/s.",
            "- req tok/s: mean over requests of output tokens / latency; norm. lat.: latency / output tokens.",
            "- prompt cached: prompt tokens the system's prefix cache served / all prompt tokens (a loop part sends "
            "each prompt right after the context its loop's earlier requests leave cached; cold parts: about 0).",
            "- accept rate = accepted / drafted tokens; mean acc. len = tokens per target pass, counting the "
            "bonus token (1.0 = plain decoding); for transformers it is output tokens / target passes (batch 1).",
            "- draft share = drafting time / (drafting + verification); goodput = tokens / that time.",
            "- speed-up: tok/s over the baseline's at the same batch size, same run.",
            "- of roofline: tok/s over B x (bandwidth / weight bytes per step); above 1 is only possible "
            "with speculation (several tokens per weight read).",
            "- = AR out: fraction of requests whose output ids equal the baseline's (bf16 rounding can differ "
            "between batched verification and one-token decoding, so greedy outputs may legitimately diverge).",
            "- rows checked / rows != decode: after its timed waves, every logit row of a few prompts was replayed "
            "(untimed) as a plain one-token decode step on the same context (bench/rowcheck.py); a lossless "
            "system has 0 rows that differ in any bit of their logits or K/V.",
            ""]
    return "\n".join(out)


def _checks(checks: list[dict]) -> list[str]:
    if not checks:
        return []
    lines = ["## Checks", ""]
    for c in checks:
        verdict = {True: "PASS", False: "FAIL", None: "info"}[c["passed"]]
        if c.get("at_most") is not None:
            value = "not measured" if c.get("value") is None else f"{c['value']:.2f}"
            lines.append(f"- **{verdict}** {c['label']}: {value} (target <= {c['at_most']}) "
                         f"[{c['metric']}: {c['a'][0]}, part {c['part']}]")
            continue
        ratio = "not measured" if c["ratio"] is None else f"{c['ratio']:.2f}x"
        verdict = {True: "PASS", False: "FAIL", None: "info"}[c["passed"]]
        target = f" (target >= {c['min_ratio']}x)" if c["min_ratio"] > 0 else ""
        lines.append(f"- **{verdict}** {c['label']}: {ratio}{target} "
                     f"[{c['metric']}: {c['a'][0]} @ {c['a'][1]} / {c['b'][0]} @ {c['b'][1]}, part {c['part']}]")
    return lines + [""]


def _speculation(part: dict) -> list[str]:
    """Acceptance by position and the cost of drafting per system, then what each fleet measured and chose."""
    base = next((r for r in part["summaries"] if r["system"] == part["baseline"] and r["batch_size"] == 1), None)
    plain_s = 1.0 / base["decode_throughput_tok_s"] if base and base.get("decode_throughput_tok_s") else None
    rows = []
    for r in part["summaries"]:
        if not r.get("drafted"):
            continue
        per_token = r["draft_time_s"] / r["drafted"] if r.get("draft_time_s") is not None else None
        row = {"system": r["system"], "batch": r["batch_size"],
               "draft ms / drafted token": None if per_token is None else round(per_token * 1e3, 2),
               "d (plain decode steps)": None if per_token is None or plain_s is None else round(per_token / plain_s, 3)}
        for i, a in enumerate(r.get("acceptance_by_position", [])[:8]):
            row[f"acc@{i + 1}"] = round(a, 3)
        rows.append(row)
    lines = []
    cov = part.get("head_vocab_coverage")
    if cov:
        lines += ["Head coverage (share of the baseline's output tokens a draft head over the first N token ids "
                  "could propose): " + ", ".join(f"N={n}: {c:.4f}" for n, c in cov.items()), ""]
    if rows:
        cols = list(dict.fromkeys(k for row in rows for k in row))
        lines += ["Drafting cost and acceptance by position (acc@i: share of steps that accepted at least i draft "
                  "tokens; d: drafting time per drafted token over the baseline's decode time per token, catch-up "
                  "and first-call prefill of a draft model's cache included):", "", md_table(rows, cols), ""]
    for s in part["systems"]:
        for i, state in enumerate(s.get("strategy_state", [])):
            for name, info in state.items():
                fleet = info.get("fleet") if isinstance(info, dict) else None
                if fleet:
                    lines += _fleet(f"{name} (round {i + 1})", fleet)
    return lines


def _fleet(title: str, f: dict) -> list[str]:
    """One fleet's own measurements (strategies/fleet.py fleet_report)."""
    members = list(f["d"])
    rows = [{"member": m, "share of steps": f["share"].get(m), "calls": f["calls"].get(m),
             "d (fitted, plain steps)": f["d"].get(m), "d s/token": _round(f["d_s"].get(m), 5),
             "catch-up s/token": _round(f.get("catch_up_s_per_token", {}).get(m), 5),
             "acceptance by position": ", ".join(f"{a:.2f}" for a in f["acceptance_by_position"].get(m, [])[:8])}
            for m in members]
    rows += [{"member": k, "share of steps": f["share"].get(k)} for k in ("merged", "plain")]
    c = f.get("c")
    lines = [f"Fleet {title}: {f['request_steps']} request steps, {f['timed_steps']} timed", "",
             md_table(rows, list(dict.fromkeys(k for row in rows for k in row))), ""]
    if c:
        lines += [f"Fitted verification cost c(n) (n draft nodes, in plain steps, batch {f['c_batch']}; plain step "
                  f"{f['step_s'] * 1e3:.1f} ms): " + ", ".join(f"c({n})={x:.2f}" for n, x in enumerate(c)), ""]
    return lines


def _round(x, digits: int):
    return None if x is None else round(x, digits)


def _part(part: dict, plots: list[Path]) -> list[str]:
    cfg = part["config"]
    sampling = "greedy" if cfg["temperature"] == 0 else \
        f"temperature {cfg['temperature']}, top-k {cfg['top_k']}, top-p {cfg['top_p']}, seed {cfg['seed']}"
    lengths = [p["prompt_tokens"] for p in part["prompts"]]
    subset = "first" if cfg["shuffle_seed"] is None else f"seed-{cfg['shuffle_seed']} shuffled"
    lines = [f"## {part['name']}", "",
             f"- target: {cfg['model']}, {cfg['dtype']} on {cfg['device']}"
             + (f", specfleet weights {cfg['quantization']} (weight-only)" if cfg.get("quantization") else "")
             + f"; baseline: {part['baseline'] or '-'}",
             f"- prompts: {subset} {len(lengths)} of {cfg['dataset']} "
             f"({'chat template' if part['chat_template'] else 'raw text'}), prompt tokens "
             f"{min(lengths)}-{max(lengths)} (mean {sum(lengths) / len(lengths):.0f})",
             f"- generation: {sampling}, up to {cfg['max_tokens']} new tokens"
             f"{', EOS ignored' if cfg['ignore_eos'] else ''}; batch sizes {list(cfg['batch_sizes'])}; "
             f"default draft length {cfg['spec_len']}"]
    if cfg.get("rounds", 1) > 1:
        lines.append(f"- rounds: {cfg['rounds']}, the systems' order alternating (as listed, then reversed); "
                     "every figure pools all rounds")
    if part["roofline_tok_s"]:
        lines.append(f"- roofline: {part['weight_bytes_per_step'] / 1e9:.2f} GB of target weights read per step "
                     f"-> at most {part['roofline_tok_s']:.2f} tok/s per sequence for plain decoding")
    for s in part["systems"]:
        if s["settings"]:
            lines.append(f"- {s['label']}: " + ", ".join(f"{k}={v}" for k, v in s["settings"].items()))
    for s in part["skipped"]:
        lines.append(f"- skipped {s['system']} at batch {s['batch_size']}: {s['reason']}")
    keys, headers = zip(*COLUMNS)
    lines += ["", md_table(part["summaries"], list(keys), list(headers)), ""]
    split = [r for r in part["summaries"] if r.get("draft_time_s") is not None and r.get("verify_time_s")]
    if split:
        lines += ["Time split (seconds summed over requests):", "",
                  md_table(split, ["system", "batch_size", "draft_time_s", "verify_time_s", "steps", "drafted",
                                   "accepted", "strategy_overhead_s", "strategy_overhead_share"]), ""]
    lines += _speculation(part)
    micro = [{"system": s["label"], "round": i + 1, **m} for s in part["systems"] for i, m in enumerate(s.get("micro", []))]
    if micro:  # the gguf preset's prefill / c(k) / memory figures (bench/gguf_micro.py)
        cols = list(dict.fromkeys(k for row in micro for k in row))
        lines += ["Prefill tok/s at fixed prompt lengths, verification cost c(k) = forward of k+1 tokens / forward "
                  "of 1 (128-token context), resident memory after the system's warm-up (MiB):", "",
                  md_table(micro, cols), ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    return lines + [""]
