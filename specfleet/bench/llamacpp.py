"""llama.cpp as a benchmark system (`llamacpp`), through the optional `llama-cpp-python` binding.

It runs the same GGUF file specfleet loads (a registered name resolves to the same assembled file),
on the same token-id prompts, greedy, one request at a time, with as many threads as torch uses.
Timings come from the token stream: TTFT is submission to the first token (the prompt's prefill plus
one sampled token), the rest are decode steps, so the report's decode tok/s means the same for both.

`available()` / `install_hint()` let the runner skip the system with one line naming the pip
command when the binding is missing, rather than fail the whole run.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from specfleet.bench.systems import Generation, Settings, SystemSpec
from specfleet.errors import SpecfleetError
from specfleet.extras import install_hint as _install_hint

KIND = "llamacpp"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def install_hint() -> str:
    return (f"{_install_hint('llamacpp')} (or `pip install llama-cpp-python`; it compiles llama.cpp, "
            "about 10 minutes on 2 cores)")


def gguf_path(model: str) -> Path:
    """The GGUF file behind a registered name or path; llama.cpp runs GGUF files only."""
    from specfleet.models.registry import resolve_model
    from specfleet.runtime.loader import is_gguf_file

    path = Path(resolve_model(model))
    if not is_gguf_file(path):
        raise SpecfleetError(f"llama.cpp runs GGUF files, and {model!r} resolves to {path}")
    return path


class LlamaCppSystem:
    def __init__(self, spec: SystemSpec, model: str, *, eos_token_ids: tuple[int, ...], n_ctx: int = 4096,
                 threads: int | None = None):
        from specfleet.extras import require

        llama_cpp = require("llama_cpp", "llamacpp", "the llama.cpp benchmark system")
        self.label = spec.label
        self.max_batch_size = 1  # the binding's high-level API decodes one sequence
        self.eos_token_ids = tuple(eos_token_ids)
        self.threads = threads or torch.get_num_threads()
        self.path = gguf_path(model)
        self.llm = llama_cpp.Llama(model_path=str(self.path), n_threads=self.threads, n_threads_batch=self.threads,
                                   n_ctx=n_ctx, n_batch=512, verbose=False)
        self.notes = {"gguf": self.path.name, "threads": self.threads, "n_ctx": n_ctx,
                      "llama_cpp_python": getattr(llama_cpp, "__version__", "?")}

    def generate(self, prompts: list[list[int]], settings: Settings) -> list[Generation]:
        if settings.temperature != 0:
            raise SpecfleetError("the llama.cpp system is measured greedy only (temperature 0)")
        return [self._one(ids, settings) for ids in prompts]

    def _one(self, prompt_ids: list[int], settings: Settings) -> Generation:
        out: list[int] = []
        self.llm.reset()
        t0 = time.perf_counter()
        ttft = None
        for tok in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                     reset=True):
            if ttft is None:
                ttft = time.perf_counter() - t0
            out.append(int(tok))
            if len(out) >= settings.max_tokens or (not settings.ignore_eos and tok in self.eos_token_ids):
                break
        return Generation(out, time.perf_counter() - t0, ttft, spec={"steps": len(out), "drafted": 0, "accepted": 0})

    def prefill_seconds(self, prompt_ids: list[int]) -> float:
        """Seconds to evaluate `prompt_ids` from an empty cache (no sampling)."""
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt_ids)
        return time.perf_counter() - t0

    def close(self) -> None:
        if hasattr(self.llm, "close"):
            self.llm.close()
        self.llm = None
