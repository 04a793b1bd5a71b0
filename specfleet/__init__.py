"""specfleet: speculative decoding with a fleet of draft models.

`from specfleet import LLM, SamplingParams` is the offline API; the names load on first use, so
importing a submodule (specfleet.core.tree, specfleet.runtime.model.decoder) does not load the engine.
"""
from __future__ import annotations

import importlib
import os

# libgomp spins a waiting thread for 300,000 rounds before it sleeps. Beside another busy process on a
# 2-core machine that spinning takes the core the working thread needs: the 1.5B decoded at 5.3 tok/s
# with it, 8.1 with a 10,000-round spin, and idle at 17.9 and 17.6 (benchmarks/kernels/threads.py; the run
# is in benchmarks/RESULTS.md). libgomp reads the variable when it loads (with torch), so it is set here,
# first; a setting of the user's own wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__all__ = ["LLM", "RequestOutput", "RuntimeConfig", "SamplingParams"]
__version__ = "0.1.0"

_EXPORTS = {"LLM": "specfleet.llm", "RequestOutput": "specfleet.outputs", "SamplingParams": "specfleet.sampling_params",
            "RuntimeConfig": "specfleet.runtime.config"}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specfleet' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
