"""Command line: `specfleet generate | models` (more sub-commands join as they land)."""
from __future__ import annotations

import argparse
import logging
import json
import sys

from specfleet.errors import SpecfleetError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from specfleet.llm import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="registered model name, HF folder or .gguf file")
    p.add_argument("--draft", default="default",
                   help="draft spec: a model name/path (NAME@N keeps N layers), 'prompt-lookup', 'ngram', "
                        "'none', or a composition such as 'vote(qwen-0.5b,prompt-lookup)+adaptive' "
                        "(grammar in specfleet/spec/compose.py); 'default' = the embedded 0.5B when the "
                        "target is the embedded 1.5B")
    p.add_argument("--spec-len", type=int, default=4, help="draft tokens per step (chain length / tree depth)")
    p.add_argument("--tree-width", type=int, default=1, help="children per tree node; 1 = chain")
    p.add_argument("--tree-nodes", type=int, default=16, help="node budget of a draft tree")
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--quantization", default="auto",
                   choices=["auto", "gguf", "none", "int8", "q4_0", "q8_0", "q4_k"],
                   help="weights of target and draft models: auto (default) = gguf for a .gguf model on the CPU, "
                        "else none; gguf = keep the file's block formats (native kernels, fp32 activations, "
                        "--dtype unused); none = dense in --dtype; int8 = weight-only int8; q4_0/q8_0/q4_k = "
                        "requantize at load. Speculation is lossless against the target as loaded")
    p.add_argument("--kv-cache-mb", type=int, default=1024, help="memory for the target's KV cache, MiB")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per engine step: decode/verify rows first, then chunks of waiting prompts")
    p.add_argument("--max-num-prefills", type=int, default=4, help="prompts prefilled side by side in one step")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_llm(args):
    from specfleet.llm import LLM, _USE_DEFAULT

    draft = _USE_DEFAULT if args.draft == "default" else args.draft
    return LLM(args.model, draft, dtype=args.dtype, device=args.device, num_speculative_tokens=args.spec_len,
               top_children=args.tree_width, max_nodes=args.tree_nodes, kv_cache_bytes=args.kv_cache_mb << 20,
               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, max_num_prefills=args.max_num_prefills,
               quantization=getattr(args, "quantization", "auto"))


def sampling_from_args(args):
    from specfleet.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_tokens=args.max_tokens, stop=args.stop)


def run_generate(args) -> int:
    from specfleet.cli_show import print_stats, show_origins

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
    _add_engine_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=run_generate)

    from specfleet.models.cli import add_models_parser, run_models

    add_models_parser(sub)
    sub.choices["models"].set_defaults(func=run_models)

    from specfleet.server.cli import add_serve_parser
    from specfleet.spec.ngram_cli import add_ngram_parser

    from specfleet.bench.cli import add_bench_parser
    from specfleet.distill.cli import add_distill_parser

    add_serve_parser(sub)
    add_ngram_parser(sub)
    add_bench_parser(sub)
    add_distill_parser(sub)

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
