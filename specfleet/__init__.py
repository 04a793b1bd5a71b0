"""specfleet: speculative decoding with a fleet of draft models.

`from specfleet import LLM, SamplingParams` is the offline API; the names load on first use, so
importing a submodule (specfleet.core.tree, specfleet.runtime.model) does not load the engine.
"""
from __future__ import annotations

import importlib

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_EXPORTS = {"LLM": "specfleet.llm", "RequestOutput": "specfleet.outputs", "SamplingParams": "specfleet.sampling_params"}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specfleet' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
