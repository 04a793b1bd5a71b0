"""`specfleet datastore build | info`: corpora for the `datastore` draft (drafting/datastore.py).

    specfleet datastore build --model qwen-1.5b                 # the standard library, into the default folder
    specfleet datastore build --model qwen-1.5b --dir ~/src/myproject --out ~/stores/myproject
    specfleet generate --draft 'fleet(suffix,prompt-lookup,datastore[path=~/stores/myproject])' ...
    specfleet datastore info ~/stores/myproject

Without --out the store goes where `datastore` (no path) looks for it: one per Python version and tokenizer.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specfleet.errors import InvalidRequestError


def add_datastore_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("datastore", help="build or inspect a source corpus for the retrieval (datastore) draft")
    sub = p.add_subparsers(dest="datastore_command", required=True)
    b = sub.add_parser("build", help="tokenize Python sources with a model's tokenizer and index them")
    b.add_argument("--model", required=True, help="the target whose tokenizer the store is built with")
    b.add_argument("--dir", action="append", default=[], help="a folder of .py sources to add (repeatable)")
    b.add_argument("--stdlib", action=argparse.BooleanOptionalAction, default=True,
                   help="include the running Python's standard library (default on)")
    b.add_argument("--out", default=None, help="folder to write (default: the folder `datastore` reads)")
    i = sub.add_parser("info", help="summarize a datastore folder")
    i.add_argument("path")
    p.set_defaults(func=run_datastore)
    return p


def run_datastore(args) -> int:
    from specfleet.drafting import datastore as ds

    if args.datastore_command == "info":
        store = ds.Datastore.load(args.path)
        meta = {k: v for k, v in store.meta.items() if k not in ("format", "version")}
        print(f"{args.path}: " + ", ".join(f"{k} {v}" for k, v in meta.items()))
        return 0
    from specfleet.drafting.cross_vocab import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise InvalidRequestError(f"model {args.model!r} has no tokenizer to build a datastore with")
    files = ds.python_sources(stdlib=args.stdlib, dirs=[Path(d).expanduser() for d in args.dir])
    if not files:
        raise InvalidRequestError("no .py sources to index: give --dir or keep --stdlib")
    out = Path(args.out).expanduser() if args.out else ds.default_folder(tokenizer)
    t0 = time.perf_counter()
    sources = ", ".join((["python standard library"] if args.stdlib else []) + [str(d) for d in args.dir])
    store = ds.build_from_files(files, tokenizer, {"sources": sources, "model": args.model})
    store.save(out)
    print(f"indexed {len(store):,} tokens from {store.meta['num_files']} files in {time.perf_counter() - t0:.1f} s; "
          f"wrote {out}", file=sys.stderr)
    return 0
