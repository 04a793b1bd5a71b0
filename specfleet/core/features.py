"""The target's hidden features of a request's committed tokens, for drafts that read them.

A feature-conditioned draft head (drafting/head.py) predicts from the target's own final hidden state
(after the final norm: the row the target's head reads). The target computes those rows anyway, so the
executor hands them on at no extra forward: after every step it writes into the request's FeatureLog
the rows of the tokens the step committed (a prompt chunk's rows; the verified prefix and the accepted
tree nodes), keyed by position. Position i's feature is the row that predicted token i + 1.

Rows are stored in fp16 (the precision a head is trained on: distill/head_data.py). A recomputed
prefix (after a preemption) overwrites from its first position on; a proposer may drop rows it has
consumed. Only requests of an engine whose proposer reads features get a log (ReadsFeatures).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class FeatureLog:
    """Rows for the positions [start, end), kept as a list of chunks."""

    def __init__(self) -> None:
        self.start = 0
        self.end = 0
        self._chunks: list[tuple[int, torch.Tensor]] = []  # (first position, rows)

    def put(self, position: int, rows: torch.Tensor) -> None:
        """Rows for positions [position, position + len(rows)); everything at or after `position` is
        replaced. A gap (rows that never arrived, say a cached prefix) restarts the log at `position`."""
        if not rows.shape[0]:
            return
        rows = rows.detach().to(torch.float16)
        if position > self.end or position < self.start or not self._chunks:
            self._chunks, self.start = [], position
        else:
            self.truncate(position)
        self._chunks.append((position, rows))
        self.end = position + rows.shape[0]

    def truncate(self, position: int) -> None:
        """Drop the rows at `position` and after."""
        kept = []
        for p, rows in self._chunks:
            if p >= position:
                break
            kept.append((p, rows[:position - p]))
        self._chunks = kept
        self.end = max(self.start, min(self.end, position))

    def rows(self, a: int, b: int) -> torch.Tensor:
        """The rows of positions [a, b) (all of them must be held)."""
        if not self.start <= a <= b <= self.end:
            raise IndexError(f"features [{a}, {b}) asked of a log holding [{self.start}, {self.end})")
        parts = [rows[max(a - p, 0):b - p] for p, rows in self._chunks if p < b and p + rows.shape[0] > a]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def discard_before(self, position: int) -> None:
        """Free the rows before `position` (already consumed)."""
        position = min(position, self.end)
        kept = []
        for p, rows in self._chunks:
            if p + rows.shape[0] <= position:
                continue
            kept.append((position, rows[position - p:]) if p < position else (p, rows))
        self._chunks = kept
        self.start = max(self.start, position)


@runtime_checkable
class ReadsFeatures(Protocol):
    """A proposer that drafts from the target's hidden features (the engine then collects them)."""

    def reads_target_features(self) -> bool: ...


def features_of(request) -> FeatureLog | None:
    """The request's feature log, or None (an engine that collects none, or a snapshot)."""
    return getattr(request, "target_features", None)


def reads_features(proposer) -> bool:
    """Whether any draft source in a composition reads the target's features."""
    if proposer is None:
        return False
    from specfleet.core.proposer import leaves

    return any(isinstance(p, ReadsFeatures) and p.reads_target_features() for p in leaves(proposer))
