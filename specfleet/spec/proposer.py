"""The Proposer protocol and a registry of draft sources by name.

A proposer drafts for a batch of requests and learns from what verification kept. Composite
strategies (voting, selection, staging) are proposers built from proposers, so the engine treats
every draft source alike and never branches on its type.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from specfleet.spec.tree import DraftTree

if TYPE_CHECKING:
    from specfleet.engine.request import Request


@dataclass(frozen=True)
class Feedback:
    """What one verification step did with one request's draft."""

    request_id: str
    tree: DraftTree
    accepted_nodes: list[int]
    num_emitted: int  # accepted + the target's token, after stop conditions cut it
    verify_time: float  # this request's share of the target forward, seconds
    committed_token_ids: list[int]  # the request's full token list after the commit

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


@runtime_checkable
class Proposer(Protocol):
    name: str

    def propose(self, requests: list["Request"]) -> dict[str, DraftTree]:
        """Draft trees for some of `requests` (keyed by request id); a request may be left out."""

    def observe(self, feedback: list[Feedback]) -> None:
        """Learn from verification; roll any per-request draft state back to the committed tokens."""

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop its state and free its memory."""


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
