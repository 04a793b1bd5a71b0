"""llama.cpp as a benchmark system (`llamacpp`): a native `llama-server` when there is one, else the
optional `llama-cpp-python` binding.

llama.cpp at its best is a native build (`cmake -DGGML_NATIVE=ON`, ../shared/PERFORMANCE.md) in its own
process with its own default threading, so where `LLAMA_SERVER` names a `llama-server` binary (or one is on
the PATH) the system starts it (`LlamaServerSystem`) with no thread or wait-policy setting of ours
(`LLAMA_SERVER_ARGS` adds options where its defaults fail on a machine, e.g. `--no-repack` on a CPU whose
AMX path crashes; the report records them). Otherwise the binding runs in this process with as many
threads as torch uses (`LlamaCppSystem`); its wheels are not always native builds, and the report says
which system ran.

Speculation (a native server only): `llamacpp:SPEC_TYPE[,draft_model=MODEL][,key=value...]` starts the server
with `--spec-type SPEC_TYPE` (e.g. `ngram-mod`, or `draft-simple` with `draft_model=qwen-0.5b`, the GGUF file
a registered draft name resolves to, passed as `-md`); any other option becomes `--key-with-dashes value`
(`spec_draft_n_max=8` -> `--spec-draft-n-max 8`). Everything else is the server's default. Its drafted and
accepted counts come from the server's own timings (`draft_n`, `draft_n_accepted`); its steps are the tokens
after the first minus the accepted ones (each step emits its accepted tokens plus one).

Either way it runs the same GGUF file specfleet loads (a registered name resolves to the same assembled
file), on the same token-id prompts, greedy, one request at a time. Timings come from the token stream:
TTFT is submission to the first token (the prompt's prefill plus one sampled token), the rest are decode
steps, so the report's decode tok/s means the same for every system.

`available()` / `install_hint()` let the runner skip the system with one line naming the pip
command when neither is there, rather than fail the whole run.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specfleet.bench.startup import wait_healthy
from specfleet.bench.systems import Generation, Settings, SystemSpec
from specfleet.errors import SpecfleetError
from specfleet.extras import install_hint as _install_hint

KIND = "llamacpp"


def native_server() -> str | None:
    """The native `llama-server` to measure against: LLAMA_SERVER, else one on the PATH, else None."""
    path = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    return path if path and os.access(path, os.X_OK) else None


def available(spec: SystemSpec | None = None) -> bool:
    """Whether this system can run here: speculation needs a native server, plain decoding either."""
    if spec is not None and (spec.draft or spec.options):
        return native_server() is not None
    return native_server() is not None or importlib.util.find_spec("llama_cpp") is not None


def make_system(spec: SystemSpec, model: str, *, eos_token_ids: tuple[int, ...], cache_prompt: bool = False):
    """The llama.cpp system for a run: the native server where there is one, else the binding. `cache_prompt`
    keeps the last request's KV so that the next one reuses the prefix they share (a loop part); off, every
    prompt is evaluated from an empty cache."""
    server = native_server()
    if server is not None:
        return LlamaServerSystem(spec, model, server, eos_token_ids=eos_token_ids, cache_prompt=cache_prompt)
    if spec.draft or spec.options:
        raise SpecfleetError(f"system {spec.label!r}: llama.cpp's speculation is measured through a native "
                             "llama-server only; set LLAMA_SERVER to one")
    return LlamaCppSystem(spec, model, eos_token_ids=eos_token_ids, cache_prompt=cache_prompt)


def spec_args(spec: SystemSpec) -> list[str]:
    """The llama-server options for a system's speculation: [] for plain `llamacpp`."""
    if not spec.draft:
        if spec.options:
            raise SpecfleetError(f"system {spec.label!r}: options need a speculation type, e.g. "
                                 "llamacpp:draft-simple,draft_model=qwen-0.5b")
        return []
    args = ["--spec-type", spec.draft]
    for key, value in spec.options.items():
        if key == "draft_model":
            args += ["-md", str(gguf_path(str(value)))]
        else:
            args += [f"--{key.replace('_', '-')}", str(value)]
    if spec.draft.startswith("draft") and "draft_model" not in spec.options:
        raise SpecfleetError(f"system {spec.label!r}: llama.cpp's {spec.draft} needs a draft model: add "
                             "draft_model=NAME (e.g. qwen-0.5b)")
    return args


def install_hint() -> str:
    return ("set LLAMA_SERVER to a native llama-server build (../shared/PERFORMANCE.md: llama.cpp at its best), or "
            f"{_install_hint('llamacpp')} (or `pip install llama-cpp-python`; it compiles llama.cpp, "
            "about 10 minutes on 2 cores)")


def gguf_path(model: str) -> Path:
    """The GGUF file behind a registered name or path; llama.cpp runs GGUF files only."""
    from specfleet.registry import resolve_model
    from specfleet.runtime.loading.checkpoint import is_gguf_file

    path = Path(resolve_model(model))
    if not is_gguf_file(path):
        raise SpecfleetError(f"llama.cpp runs GGUF files, and {model!r} resolves to {path}")
    return path


class _Greedy:
    """What both llama.cpp systems share: greedy, one request at a time (`_one`)."""

    max_batch_size = 1

    def generate(self, prompts: list[list[int]], settings: Settings) -> list[Generation]:
        if settings.temperature != 0:
            raise SpecfleetError("the llama.cpp system is measured greedy only (temperature 0)")
        return [self._one(ids, settings) for ids in prompts]


class LlamaCppSystem(_Greedy):
    def __init__(self, spec: SystemSpec, model: str, *, eos_token_ids: tuple[int, ...], n_ctx: int = 4096,
                 threads: int | None = None, cache_prompt: bool = False):
        from specfleet.extras import require

        llama_cpp = require("llama_cpp", "llamacpp", "the llama.cpp benchmark system")
        self.label = spec.label  # (one sequence at a time: the binding's high-level API decodes one)
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_prompt = cache_prompt
        self.threads = threads or torch.get_num_threads()
        self.path = gguf_path(model)
        self.llm = llama_cpp.Llama(model_path=str(self.path), n_threads=self.threads, n_threads_batch=self.threads,
                                   n_ctx=n_ctx, n_batch=512, verbose=False)
        self.notes = {"gguf": self.path.name, "threads": self.threads, "n_ctx": n_ctx, "runs": "llama-cpp-python",
                      "llama_cpp_python": getattr(llama_cpp, "__version__", "?")}

    def _one(self, prompt_ids: list[int], settings: Settings) -> Generation:
        out: list[int] = []
        cached = 0
        if self.cache_prompt:  # the binding's generate() keeps the longest prefix its context shares with the prompt
            cached = next((i for i, (a, b) in enumerate(zip(self.llm.eval_tokens, prompt_ids[:-1])) if a != b),
                          min(len(self.llm.eval_tokens), len(prompt_ids) - 1))
        else:
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
        return Generation(out, time.perf_counter() - t0, ttft,
                          spec={"steps": len(out), "drafted": 0, "accepted": 0, "cached_tokens": cached})

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


class LlamaServerSystem(_Greedy):
    """A native `llama-server` in its own process (its own default threading; no OMP_* variable of ours
    reaches it), driven over HTTP on its `/completion` endpoint with token-id prompts, greedy, streamed."""

    def __init__(self, spec: SystemSpec, model: str, binary: str, *, eos_token_ids: tuple[int, ...],
                 n_ctx: int = 4096, startup_s: float = 600.0, cache_prompt: bool = False):
        import httpx

        self._httpx = httpx
        self.label = spec.label
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_prompt = cache_prompt
        self.path = gguf_path(model)
        extra = shlex.split(os.environ.get("LLAMA_SERVER_ARGS", ""))
        speculation = spec_args(spec)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [binary, "-m", str(self.path), "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", str(n_ctx),
               *speculation, *extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{port}"
        self.notes = {"gguf": self.path.name, "runs": "llama-server (native, own process)", "binary": binary,
                      "args": extra, "threads": "llama.cpp's default", "n_ctx": n_ctx, "speculation": speculation}
        try:
            wait_healthy(self.proc, self.url, startup_s, self._tail)
        except SpecfleetError:
            self.close()
            raise

    def _tail(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def _body(self, prompt_ids: list[int], n_predict: int, ignore_eos: bool, stream: bool,
              cache_prompt: bool = False) -> dict:
        return {"prompt": list(prompt_ids), "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "top_p": 1.0,
                "min_p": 0.0, "repeat_penalty": 1.0, "cache_prompt": cache_prompt, "ignore_eos": ignore_eos,
                "stream": stream, "return_tokens": True}

    def _one(self, prompt_ids: list[int], settings: Settings) -> Generation:
        out: list[int] = []
        t0 = time.perf_counter()
        ttft = None
        timings: dict = {}
        body = self._body(prompt_ids, settings.max_tokens, settings.ignore_eos, True, self.cache_prompt)
        with self._httpx.stream("POST", self.url + "/completion", json=body, timeout=3600) as r:
            if r.status_code != 200:
                raise SpecfleetError(f"llama-server answered {r.status_code}: {r.read().decode(errors='replace')[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                toks = chunk.get("tokens") or []
                if toks and ttft is None:
                    ttft = time.perf_counter() - t0
                out.extend(int(t) for t in toks)
                if chunk.get("stop"):
                    timings = chunk.get("timings") or {}
                    break
        out = out[:settings.max_tokens]
        spec = server_spec_counts(len(out), timings)
        if "cache_n" in timings:
            spec["cached_tokens"] = int(timings["cache_n"])  # prompt tokens the server reused from its cache
        return Generation(out, time.perf_counter() - t0, ttft, spec=spec)

    def prefill_seconds(self, prompt_ids: list[int]) -> float:
        """Seconds the server reports for evaluating `prompt_ids` from an empty cache (its own prompt timing)."""
        r = self._httpx.post(self.url + "/completion", json=self._body(prompt_ids, 1, True, False), timeout=3600)
        if r.status_code != 200:
            raise SpecfleetError(f"llama-server answered {r.status_code}: {r.text[:500]}")
        return float(r.json()["timings"]["prompt_ms"]) / 1000.0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def server_spec_counts(num_tokens: int, timings: dict) -> dict:
    """Steps, drafted and accepted tokens of one request from llama-server's final timings: the server counts
    drafted (`draft_n`) and accepted (`draft_n_accepted`) tokens; every decode step after the prefill's token
    emits its accepted tokens plus one, so steps = tokens - 1 - accepted (plain decoding: tokens - 1, and then
    the steps are one per token as before)."""
    drafted, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
    if not drafted:
        return {"steps": num_tokens, "drafted": 0, "accepted": 0}
    return {"steps": max(1, num_tokens - 1 - accepted), "drafted": drafted, "accepted": accepted}
