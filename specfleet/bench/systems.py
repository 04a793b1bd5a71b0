"""The systems a benchmark compares, behind one small interface.

A system is named by a string:
    specfleet:DRAFT[,key=value...]   specfleet with a draft (opaque: a model name/path, `none`,
                                     `prompt-lookup`, or any strategy the proposer factory knows)
    hf                               transformers `generate`, greedy or sampled
    hf-assisted:DRAFT[,k=N]          transformers assisted generation: a draft model, or prompt
                                     lookup for `prompt-lookup`/`ngram` (batch size 1 only)
    llamacpp                         llama.cpp on the same GGUF file (bench/llamacpp.py; batch size 1,
                                     greedy; needs the `llamacpp` extra, skipped with a hint without it)
    llamacpp:SPEC_TYPE[,draft_model=M,key=value...]   a native llama-server with `--spec-type SPEC_TYPE`
                                     (ngram-mod; draft-simple with draft_model=qwen-0.5b as `-md`)
Shorthands: `ar` = `specfleet:none`, `transformers` = `hf`. specfleet options: k (draft tokens per
step), width (tree branching), nodes (tree node budget); any other key is passed to `LLM(...)` as a
keyword (so new engine settings, such as pipelining, need no change here).

Every system takes token-id prompts (tokenized once by the runner, so all systems see the same
ids) and returns one Generation per prompt with its own timings.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Protocol

from specfleet.errors import SpecfleetError
from specfleet.strategies.spec_language import MODEL_ALIASES

SHORTHANDS = {"ar": "specfleet:none", "specfleet": "specfleet:none", "transformers": "hf"}
KINDS = ("specfleet", "hf", "hf-assisted", "llamacpp")
_OPTION = re.compile(r"^[A-Za-z_]\w*=")
SPECFLEET_OPTIONS = MODEL_ALIASES  # the draft spec's short names: k, width, nodes


@dataclass(frozen=True)
class SystemSpec:
    label: str  # exactly as the user wrote it: the name in tables, plots and checks
    kind: str
    draft: str | None = None
    options: dict = field(default_factory=dict, hash=False)

    @property
    def is_autoregressive(self) -> bool:
        return self.kind == "specfleet" and (self.draft or "none").lower() == "none"


def parse_system(text: str) -> SystemSpec:
    """`specfleet:vote(a,b),k=6` -> kind specfleet, draft `vote(a,b)`, options {k: 6}.

    Options are the trailing comma-separated `key=value` parts; anything before them belongs to the
    draft name, commas included, so composite draft names pass through untouched.
    """
    label = text.strip()
    full = SHORTHANDS.get(label, label)
    kind, _, rest = full.partition(":")
    if kind not in KINDS:
        raise SpecfleetError(f"unknown system {text!r}; write specfleet:DRAFT, hf, or hf-assisted:DRAFT "
                             f"(shorthands: {', '.join(SHORTHANDS)})")
    parts = _split_top_level(rest) if rest else []
    options = {}
    while parts and _OPTION.match(parts[-1]):
        key, _, value = parts.pop().partition("=")
        options[key] = _literal(value)
    draft = ",".join(parts) or None
    if kind == "specfleet" and draft is None:
        draft = "none"
    if kind == "hf" and draft is not None:
        raise SpecfleetError(f"system {text!r}: hf takes no draft; use hf-assisted:{draft}")
    if kind == "llamacpp" and draft is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", draft):
        raise SpecfleetError(f"system {text!r}: llamacpp:SPEC_TYPE takes one of llama-server's --spec-type names "
                             f"(e.g. ngram-mod, draft-simple), got {draft!r}")
    if kind == "hf-assisted" and (draft is None or draft.lower() == "none"):
        raise SpecfleetError(f"system {text!r}: hf-assisted needs a draft, e.g. hf-assisted:qwen-0.5b")
    return SystemSpec(label, kind, draft, dict(reversed(options.items())))


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and parentheses: `a[x=1,y=2],k=3` -> [`a[x=1,y=2]`, `k=3`]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _literal(value: str):
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


@dataclass(frozen=True)
class Settings:
    """What every system is asked to do for one wave."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False


@dataclass
class Generation:
    output_ids: list[int]
    latency_s: float  # submission to last token
    ttft_s: float | None
    num_first_tokens: int = 1  # tokens already out at ttft_s (the prefill's one, or an assisted pass's)
    spec: dict = field(default_factory=dict)  # steps, drafted, accepted, draft/verify time, depth counts


class System(Protocol):
    label: str
    max_batch_size: int | None  # None: any batch size
    notes: dict  # settings worth recording in the report

    def generate(self, prompts: list[list[int]], settings: Settings) -> list[Generation]: ...

    def close(self) -> None: ...


class SpecfleetSystem:
    """specfleet's offline API with the target model built once and handed in (shared by systems)."""

    def __init__(self, spec: SystemSpec, model_name: str, target, tokenizer, *, dtype: str, device: str,
                 spec_len: int, max_batch_size: int, kv_cache_mb: int | None):
        from specfleet.llm import LLM

        kwargs = {"num_speculative_tokens": spec_len, "max_num_seqs": max(1, max_batch_size)}
        if kv_cache_mb:
            kwargs["kv_cache_bytes"] = kv_cache_mb << 20
        kwargs.update({SPECFLEET_OPTIONS.get(k, k): v for k, v in spec.options.items()})
        try:
            self.llm = LLM.from_model(target, tokenizer, spec.draft, name=model_name, dtype=dtype, device=device,
                                      **kwargs)
        except TypeError as e:  # an option LLM does not take
            raise SpecfleetError(f"system {spec.label!r}: {e}") from e
        self.label = spec.label
        self.max_batch_size = None
        self.notes = {k: v for k, v in kwargs.items() if k != "kv_cache_bytes"} | {"draft": spec.draft}

    def generate(self, prompts: list[list[int]], settings: Settings) -> list[Generation]:
        from specfleet.sampling_params import SamplingParams

        greedy = settings.temperature == 0
        params = [SamplingParams(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                                 seed=None if greedy else settings.seed + i, max_tokens=settings.max_tokens,
                                 ignore_eos=settings.ignore_eos) for i in range(len(prompts))]
        before = self._overhead()
        gens = [_generation(o) for o in self.llm.generate(prompts, params)]
        spent = self._overhead() - before
        if self.llm.engine.proposer is not None:
            for g in gens:  # the decisions serve the whole wave: an equal share per request
                g.spec["strategy_overhead_s"] = spent / len(gens)
        return gens

    def strategy_state(self) -> dict:
        """What the composition's strategies learned and measured (core/proposer.describe): for a fleet
        its members' shares of the steps, their measured d, the fitted c(k), acceptance by position."""
        from specfleet.core.proposer import describe

        proposer = self.llm.engine.proposer
        return {} if proposer is None else describe(proposer)

    def _overhead(self) -> float:
        from specfleet.core.proposer import total_overhead

        proposer = self.llm.engine.proposer
        return 0.0 if proposer is None else total_overhead(proposer)

    def close(self) -> None:
        del self.llm


def _generation(out) -> Generation:
    m = out.metrics
    steps = m.get("steps", 0)
    depth = [round(rate * steps) for rate in m.get("acceptance_by_position", [])]
    spec = {"steps": steps, "drafted": m.get("drafted", 0), "accepted": m.get("accepted", 0),
            "draft_time_s": m.get("draft_time_s", 0.0), "verify_time_s": m.get("verify_time_s", 0.0),
            "accepted_at_depth": depth, "cached_tokens": m.get("num_cached_tokens"), "judged": m.get("judged")}
    return Generation(list(out.token_ids), m["latency_s"], m.get("ttft_s"), spec=spec)
