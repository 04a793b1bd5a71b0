"""DraftTree: the one layout every draft source produces and the verifier consumes.

Nodes are stored in topological order (a parent's index is below its children's). Parent -1 means
the node continues the request's last committed token, which we call the root; the root itself is
not part of the tree. A chain is a tree in which node i has parent i - 1.

Worked example: a root "The" with drafts "cat sat" and "dog":

    index     0     1     2
    token    cat   sat   dog
    parent   -1     0    -1
    depth     1     2     1

Verification feeds [root, cat, sat, dog] to the target at positions ctx+0, ctx+1, ctx+2, ctx+1 with
`verify_mask()`: each row sees the root and its own ancestors.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch


@dataclass
class DraftTree:
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    # draft_probs[j] is the distribution node j was drawn from (the proposer's q at node j's parent),
    # [num_nodes, vocab]; None for deterministic proposers, whose proposals count as point masses
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.parents) != n or len(self.origins) != n:
            raise ValueError("token_ids, parents and origins must have one entry per node")
        for j, p in enumerate(self.parents):
            if not -1 <= p < j:
                raise ValueError(f"node {j} has parent {p}; parents must precede their children")
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise ValueError("draft_probs needs one row per node")

    @classmethod
    def chain(cls, token_ids: list[int], origin: str, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), [origin] * len(token_ids), draft_probs)

    def __len__(self) -> int:
        return len(self.token_ids)

    def subtree(self, keep: list[int]) -> "DraftTree":
        """The nodes `keep` (sorted, closed under ancestors) re-indexed into a tree (self when all)."""
        if len(keep) == len(self):
            return self
        index = {old: new for new, old in enumerate(keep)}
        probs = None if self.draft_probs is None else self.draft_probs[keep]
        return DraftTree([self.token_ids[j] for j in keep], [index[self.parents[j]] if self.parents[j] >= 0 else -1
                                                             for j in keep], [self.origins[j] for j in keep], probs)

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 for the root), in index order."""
        return [j for j, p in enumerate(self.parents) if p == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first level down to `node` inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        has_child = set(p for p in self.parents if p >= 0)
        return [j for j in range(len(self)) if j not in has_child]

    def verify_mask(self) -> np.ndarray:
        """[n+1, n+1] bool over [root, nodes...]: row i may see column j iff j is i or an ancestor of i.
        Host data (numpy): the runner decides layouts from it and sends the device one copy."""
        n = len(self)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        mask[0, 0] = True
        for j, p in enumerate(self.parents):
            row = j + 1
            if p >= 0:
                mask[row] = mask[p + 1]
            mask[row, row] = True
        return mask

    def verify_positions(self, root_position: int) -> list[int]:
        return [root_position] + [root_position + d for d in self.depths()]

    def truncated(self, max_nodes: int) -> "DraftTree":
        """The first `max_nodes` nodes (still a valid tree because parents precede children)."""
        probs = None if self.draft_probs is None else self.draft_probs[:max_nodes]
        return DraftTree(self.token_ids[:max_nodes], self.parents[:max_nodes], self.origins[:max_nodes], probs)


def best_first_tree(children: Callable[[object, int], Iterable[tuple[int, float, object]]], root: object, budget: int,
                    max_depth: int, min_prob: float, origin: str) -> tuple[DraftTree, float]:
    """A tree grown best first from counts (the suffix and datastore drafts): `children(state, depth)` yields
    (token, share among its siblings, child state) below a node at `depth` (0: the root). A node's score is the
    product of the shares on its path; nodes below `min_prob` are not proposed, nodes are added in order of
    falling score (parents before children, siblings most likely first, ties in the order offered) until
    `budget`, none deeper than `max_depth`. Returns the tree and its summed score."""
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    heap: list = []  # (-score, tie, parent, token, state, depth)
    tie = 0

    def offer(parent: int, state, prob: float, depth: int) -> None:
        nonlocal tie
        for tok, share, child in children(state, depth):
            if prob * share >= min_prob:
                heapq.heappush(heap, (-prob * share, tie, parent, tok, child, depth + 1))
                tie += 1

    offer(-1, root, 1.0, 0)
    while heap and len(tokens) < budget:
        neg, _, parent, tok, state, depth = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        score -= neg
        if depth < max_depth:
            offer(len(tokens) - 1, state, -neg, depth)
    return DraftTree(tokens, parents, [origin] * len(tokens)), score
