"""Optional features and the pip extra that brings each one.

The main install (`pip install specfleet`) covers generation, the model registry and the
OpenAI-compatible server. A few features need packages that most users never want: Ray for draft
workers in other processes, matplotlib and the prompt-set packages for benchmark plots and data,
llama-cpp-python for the llama.cpp baseline. Code that needs one calls `require`, which turns a
missing package into one line naming the exact pip command (the CLI prints it and exits 2) instead
of a traceback from deep inside the feature.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from specfleet.errors import SpecfleetError

# extra -> the pip requirement text a user types (the packages themselves are in pyproject.toml)
EXTRAS = {
    "serve": "specfleet[serve]",
    "bench": "specfleet[bench]",
    "pipeline": "specfleet[pipeline]",
    "llamacpp": "specfleet[llamacpp]",
    "cluster": "specfleet[cluster]",
}


class MissingExtraError(SpecfleetError):
    """An optional feature was used without the package it needs."""


def install_hint(extra: str) -> str:
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {sorted(EXTRAS)}")
    return f"pip install '{EXTRAS[extra]}'"


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module` for `feature`, or raise MissingExtraError naming `pip install 'specfleet[extra]'`."""
    hint = install_hint(extra)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise MissingExtraError(f"{feature} needs the package {top!r}, which is not installed: {hint}") from e
