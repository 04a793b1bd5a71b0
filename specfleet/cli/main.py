"""`specfleet`: the command line; `generate` lives here, the other sub-commands in their packages."""
from __future__ import annotations

import argparse
import logging
import json
import sys

from specfleet.cli.common import add_engine_args, add_sampling_args, build_llm, sampling_from_args
from specfleet.errors import SpecfleetError


def run_generate(args) -> int:
    from specfleet.cli.show import print_stats, show_origins

    if (args.prompt is None) == (args.prompts_file is None):
        raise SpecfleetError("give exactly one of --prompt or --prompts-file")
    params = sampling_from_args(args)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise SpecfleetError(f"cannot read prompts file {args.prompts_file!r}: {e.strerror}") from e
        if not prompts:
            raise SpecfleetError(f"prompts file {args.prompts_file!r} has no prompts")
    else:
        prompts = [args.prompt]
    llm = build_llm(args)
    if len(prompts) == 1 and not args.json:
        last = None
        for delta, out in llm.stream(prompts[0], params, chat=args.chat):
            if not args.show_origins:
                sys.stdout.write(delta)
                sys.stdout.flush()
            last = out
        if args.show_origins and last is not None:
            show_origins(llm.tokenizer, last)
        sys.stdout.write("\n")
        print_stats(last.metrics if last else {}, file=sys.stderr)
        return 0
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=True)
    else:
        outs = llm.generate(prompts, params, use_tqdm=True)
    for p, o in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": p, "text": o.text, "finish_reason": o.finish_reason, "metrics": o.metrics}))
        else:
            print(f"### {p}\n{o.text}\n")
    print_stats(llm.aggregate_stats(), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specfleet", description="Speculative decoding with a fleet of drafts")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (streams for one prompt, progress bar for many)")
    g.add_argument("--prompt", help="the prompt text")
    g.add_argument("--prompts-file", help="a text file with one prompt per line")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt as a user message in the model's chat template (default on)")
    g.add_argument("--json", action="store_true", help="print one JSON line per prompt")
    g.add_argument("--show-origins", action="store_true", help="colour each token by who produced it")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=run_generate)

    from specfleet.cli.models import add_models_parser, run_models

    add_models_parser(sub)
    sub.choices["models"].set_defaults(func=run_models)

    from specfleet.cli.cluster import add_cluster_parser
    from specfleet.cli.serve import add_serve_parser
    from specfleet.cli.ngram import add_ngram_parser
    from specfleet.cli.datastore import add_datastore_parser

    from specfleet.bench.cli import add_bench_parser
    from specfleet.distill.cli import add_distill_parser
    from specfleet.distill.head_cli import add_draft_parser

    add_serve_parser(sub)
    add_cluster_parser(sub)
    add_ngram_parser(sub)
    add_datastore_parser(sub)
    add_bench_parser(sub)
    add_distill_parser(sub)
    add_draft_parser(sub)

    args = parser.parse_args(argv)
    # the loader reports one-time conversions at INFO; a minute of silence would look like a hang
    logging.basicConfig(level=logging.INFO, format="specfleet: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except SpecfleetError as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
