"""The Proposer protocol, the optional capabilities a proposer may have, and a registry by name.

A proposer drafts for a batch of requests and learns from what verification kept. Composite
strategies (voting, selection, staging, the fleet) are proposers built from proposers, so the engine
treats every draft source alike and never branches on its type.

Beyond the three required methods a proposer may offer capabilities, each a protocol of its own
that callers test with `isinstance` (never by probing attribute names):

    SpeculationLength   reads and sets how deep it drafts (the adaptive controller, the gauge)
    FreesKV             keeps per-request draft KV and can drop it alone
    PreparesKV          can catch its draft KV up on a request's tokens ahead of use
    Composite           is built from `children`
    StateReporter       reports live state (weights, lengths, assignments, overheads)
    ModelBacked         drafts with a model whose parameters count towards its cost
    DraftWeights        reports per-member weights (vote, select)
    DraftStats          reports per-member drafted and accepted tokens (vote, select, fleet)

Proposers only see requests through `RequestView`, a read-only view of the engine's request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import torch

from specfleet.core.tree import DraftTree
from specfleet.sampling_params import SamplingParams


@runtime_checkable
class RequestView(Protocol):
    """What a proposer may read of a request. Proposers never write to it."""

    @property
    def request_id(self) -> str: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + committed output tokens; do not mutate (the engine appends to it between steps)."""

    @property
    def num_tokens(self) -> int: ...


@dataclass
class RequestSnapshot:
    """A request's tokens copied out of the engine: what a background thread (a selector preparing a
    switch) or another process (a remote draft worker's mirror) drafts from."""

    request_id: str
    all_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    num_prompt_tokens: int | None = None  # None: every token counts as prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        n = len(self.all_token_ids) if self.num_prompt_tokens is None else self.num_prompt_tokens
        return self.all_token_ids[:n]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass(frozen=True)
class Feedback:
    """What one verification step did with one request's draft."""

    request_id: str
    tree: DraftTree
    accepted_nodes: list[int]
    num_emitted: int  # accepted + the target's token, after stop conditions cut it
    verify_time: float  # this request's share of the target forward, seconds
    emitted_token_ids: list[int] = field(default_factory=list)  # the tokens this step committed

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


@runtime_checkable
class Proposer(Protocol):
    name: str

    def propose(self, requests: list[RequestView]) -> dict[str, DraftTree]:
        """Draft trees for some of `requests` (keyed by request id); a request may be left out."""

    def observe(self, feedback: list[Feedback]) -> None:
        """Learn from verification; roll any per-request draft state back to the committed tokens."""

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop its state and free its memory."""


# -- optional capabilities -----------------------------------------------------------------------
@runtime_checkable
class SpeculationLength(Protocol):
    """Drafts `num_speculative_tokens` deep (a chain's length, a tree's depth), and can be told to
    change it (by the adaptive controller, an enclosing strategy or the user)."""

    @property
    def num_speculative_tokens(self) -> int: ...

    def set_num_speculative_tokens(self, n: int) -> None: ...


@runtime_checkable
class FreesKV(Protocol):
    """Keeps per-request draft KV between steps, and can drop it alone."""

    def free_kv(self, request_id: str) -> None:
        """Drop the request's draft KV but keep the rest of its state (a sampled request's generator
        must not restart from its seed when a selector switches it away and back)."""


@runtime_checkable
class PreparesKV(Protocol):
    """Has draft KV (or members with draft KV) that can be caught up ahead of use."""

    def prepare(self, requests: list[RequestView]) -> None:
        """Catch the draft KV up on the requests' committed tokens except the last (the next draft's
        root), ahead of a switch to this proposer."""


@runtime_checkable
class Composite(Protocol):
    """Built from other proposers."""

    children: list


@runtime_checkable
class StateReporter(Protocol):
    def state(self) -> dict:
        """Live state for /metrics and the CLI; `overhead_s` maps each strategy cost to seconds."""


@runtime_checkable
class ModelBacked(Protocol):
    """Drafts with a model; a `torch.nn.Module` one costs a forward per draft step (an n-gram table
    is a model too, but weightless)."""

    model: object


@runtime_checkable
class DraftWeights(Protocol):
    @property
    def weights(self) -> dict[str, float]:
        """Member name -> weight (vote) or estimated goodput (select)."""


@runtime_checkable
class DraftStats(Protocol):
    @property
    def draft_stats(self) -> dict[str, dict]:
        """Member name -> drafted / accepted tokens of the drafts it made."""


# -- walking a composed proposer ------------------------------------------------------------------
def leaves(p: Proposer) -> list[Proposer]:
    """The draft sources at the bottom of a composition (the proposer itself if it has none)."""
    kids = p.children if isinstance(p, Composite) else None
    return [leaf for k in kids for leaf in leaves(k)] if kids else [p]


def model_size(p: Proposer) -> int:
    """Parameters behind a proposer (weightless ones count 0)."""
    models = {id(leaf.model): leaf.model for leaf in leaves(p)
              if isinstance(leaf, ModelBacked) and isinstance(leaf.model, torch.nn.Module)}
    return sum(sum(t.numel() for t in m.parameters()) for m in models.values())


@dataclass(frozen=True)
class StepTiming:
    """What the engine measured between two draftings. The engine is the one clock: strategies that adapt to
    cost (the fleet's step-cost model, the length controller) read this instead of timing the gaps between
    their own calls, so every part of a composition sees the same seconds."""

    seconds: float  # from the end of the previous drafting to the start of this one (verify, commit, schedule)
    draft_seconds: float  # the previous drafting itself
    verify_seconds: float  # the target's forwards within `seconds`
    batch: int  # requests about to be drafted for
    # rows computed within `seconds` for prompt chunks (or recomputation) of requests other than the drafted
    # ones: those steps cost more than the decode steps of the drafted batch, so cost models skip them
    prompt_rows: int = 0
    # target forwards within `seconds` that were one-off warm-ups (a CUDA graph captured at its shape's first
    # step, three forwards in one): not what a step of this shape costs, so cost models skip them too
    warmups: int = 0
    # the target runs every request of a step at the step's largest number of new rows (CUDA graphs pad a ragged
    # batch: runtime/backends/cuda/graphs.py), so a step costs its batch times its widest tree, not the sum of the
    # trees' nodes; cost models that price nodes price padded rows then
    padded_rows: bool = False


@runtime_checkable
class ObservesSteps(Protocol):
    def observe_step(self, timing: StepTiming) -> None:
        """The engine's measurement of the step(s) since this composition last drafted."""


def observe_step(p: Proposer, timing: StepTiming) -> None:
    """Hand the engine's measured step to every part of a composition that adapts to time (once each)."""
    seen: set[int] = set()

    def walk(q) -> None:
        if id(q) in seen:
            return
        seen.add(id(q))
        if isinstance(q, ObservesSteps):
            q.observe_step(timing)
        if isinstance(q, Composite):
            for c in q.children:
                walk(c)

    walk(p)


def set_speculation_length(p: Proposer, n: int) -> bool:
    """Tell a proposer to draft `n` tokens deep; False when it has no such setting."""
    if isinstance(p, SpeculationLength):
        p.set_num_speculative_tokens(n)
        return True
    return False


def speculation_length(p: Proposer | None) -> int | None:
    """How deep a proposer drafts now (an adaptive controller's current length), or None."""
    return p.num_speculative_tokens if isinstance(p, SpeculationLength) else None


def free_kv(p: Proposer, request_id: str) -> None:
    """Drop a request's draft KV from a leaf that holds any (a request switched away from it)."""
    if isinstance(p, FreesKV):
        p.free_kv(request_id)


def prepare_kv(p: Proposer, requests: list[RequestView]) -> None:
    """Catch a proposer's draft caches up on the requests' committed tokens; weightless proposers
    have nothing to prepare."""
    if isinstance(p, PreparesKV):
        p.prepare(requests)


def describe(proposer: Proposer) -> dict:
    """Live state of every strategy in a composition, keyed by name: vote weights, current adaptive
    lengths, selector assignments and goodput estimates, fleet choices, measured overheads."""
    out: dict = {}

    def walk(p) -> None:
        info = p.state() if isinstance(p, StateReporter) else {}
        if info:
            out[p.name] = info
        if isinstance(p, Composite):
            for c in p.children:
                walk(c)

    walk(proposer)
    return out


def total_overhead(proposer: Proposer) -> float:
    """Seconds spent in voting, weight updates, fitting, matching and deciding across a composition."""
    return sum(sum(v.get("overhead_s", {}).values()) for v in describe(proposer).values())


# -- registry of draft sources by name ------------------------------------------------------------
ProposerFactory = Callable[..., Proposer]
_REGISTRY: dict[str, ProposerFactory] = {}


def register(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def deco(factory: ProposerFactory) -> ProposerFactory:
        _REGISTRY[name] = factory
        return factory
    return deco


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def get_factory(name: str) -> ProposerFactory:
    from specfleet.errors import InvalidRequestError

    if name not in _REGISTRY:
        raise InvalidRequestError(f"unknown draft {name!r}; known drafts: {registered_names()}")
    return _REGISTRY[name]
