"""`specfleet ngram build | info`: n-gram tables for the `ngram` draft and the `MODEL+ngram` stage.

The staged-speculation paper builds its trigram tables from text the draft model generates (sampled
hot, so the tables cover what the draft might say, not only its single most likely path) and we add
the prompts themselves:

    specfleet ngram build --prompts-file prompts.txt --generate-tokens 128 --out tables.json.gz
    specfleet ngram build --text-file corpus.txt --out tables.json      # just tokenize and count
    specfleet ngram build --token-ids-file ids.txt --out tables.json    # pre-tokenized, no model
    specfleet generate --draft 'qwen-0.5b+ngram[path=tables.json.gz]' ...     # or --draft 'ngram[path=...]'
"""
from __future__ import annotations

import argparse
import sys

from specfleet.errors import InvalidRequestError, SpecfleetError
from specfleet.drafting.ngram_model import NgramModel


def add_ngram_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ngram", help="build or inspect n-gram tables for staged speculation")
    sub = p.add_subparsers(dest="ngram_command", required=True)
    b = sub.add_parser("build", help="count n-grams in prompts, text and draft-generated continuations")
    b.add_argument("--out", required=True, help="tables file to write (.json, or .json.gz to compress)")
    b.add_argument("--prompts-file", action="append", default=[], help="one prompt per line (repeatable)")
    b.add_argument("--text-file", action="append", default=[], help="a text corpus, counted whole (repeatable)")
    b.add_argument("--token-ids-file", action="append", default=[],
                   help="one sequence of whitespace-separated token ids per line; needs no model (repeatable)")
    b.add_argument("--model", default="qwen-0.5b", help="tokenizer and generator: the draft whose text to model")
    b.add_argument("--generate-tokens", type=int, default=0,
                   help="also count this many tokens the model generates after each prompt (0 = none)")
    b.add_argument("--temperature", type=float, default=1.5, help="sampling temperature of that generation")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap prompts in the chat template, as `specfleet generate` does (default on)")
    b.add_argument("--order", type=int, default=3, help="longest n-gram (3 = trigram)")
    b.add_argument("--min-count", type=int, default=1, help="drop n-grams seen fewer times from the file")
    b.add_argument("--dtype", default="bfloat16")
    b.add_argument("--device", default="cpu")
    i = sub.add_parser("info", help="summarize a tables file")
    i.add_argument("path")
    p.set_defaults(func=run_ngram)
    return p


def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
        raise InvalidRequestError(f"cannot read {path!r}: {e.strerror}") from e


def _token_ids(path: str) -> list[list[int]]:
    seqs = []
    for n, line in enumerate(_lines(path), 1):
        try:
            seqs.append([int(t) for t in line.split()])
        except ValueError:
            raise InvalidRequestError(f"{path}:{n}: expected whitespace-separated token ids, got {line[:40]!r}") from None
        if any(t < 0 for t in seqs[-1]):
            raise InvalidRequestError(f"{path}:{n}: token ids must be non-negative")
    return seqs


def _model_sequences(args) -> list[list[int]]:
    """Tokenized prompts (plus generated continuations) and texts, through the model's tokenizer."""
    from specfleet.llm import LLM
    from specfleet.sampling_params import SamplingParams

    llm = LLM(args.model, draft=None, dtype=args.dtype, device=args.device)
    seqs: list[list[int]] = []
    prompts = [p for f in args.prompts_file for p in _lines(f)]
    ids = [llm.apply_chat_template([{"role": "user", "content": p}]) if args.chat else llm.encode(p) for p in prompts]
    if ids and args.generate_tokens > 0:
        params = [SamplingParams(temperature=args.temperature, max_tokens=args.generate_tokens, seed=args.seed + n)
                  for n in range(len(ids))]
        outs = llm.generate(ids, params, use_tqdm=True)
        seqs.extend(p + o.token_ids for p, o in zip(ids, outs))
    else:
        seqs.extend(ids)
    for path in args.text_file:
        try:
            with open(path, encoding="utf-8") as f:
                seqs.append(llm.encode(f.read()))
        except OSError as e:
            raise InvalidRequestError(f"cannot read {path!r}: {e.strerror}") from e
    return seqs


def run_ngram(args) -> int:
    if args.ngram_command == "info":
        m = NgramModel.load(args.path)
        rows = [sum(len(r) for r in t.values()) for t in m.tables]
        print(f"{args.path}: order {m.order}, " + ", ".join(f"{n + 1}-grams {c:,}" for n, c in enumerate(rows)))
        return 0
    if args.order < 1 or args.min_count < 1 or args.generate_tokens < 0:
        raise InvalidRequestError("--order and --min-count must be >= 1 and --generate-tokens >= 0")
    if not (args.prompts_file or args.text_file or args.token_ids_file):
        raise InvalidRequestError("nothing to count: give --prompts-file, --text-file or --token-ids-file")
    seqs = [s for f in args.token_ids_file for s in _token_ids(f)]
    if args.prompts_file or args.text_file:
        seqs.extend(_model_sequences(args))
    model = NgramModel(args.order)
    for s in seqs:
        model.add(s)
    model.save(args.out, args.min_count)
    print(f"counted {sum(map(len, seqs)):,} tokens in {len(seqs)} sequences; wrote {model.num_entries:,} "
          f"n-gram entries (order {args.order}) to {args.out}", file=sys.stderr)
    return 0


def run_ngram_args(argv: list[str]) -> int:
    """`specfleet ngram ...` on its own (tests, and until the main CLI wires it in)."""
    parser = argparse.ArgumentParser(prog="specfleet")
    add_ngram_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["ngram", *argv])
    try:
        return args.func(args)
    except SpecfleetError as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 2
