"""Lossless verification of a draft tree: pure functions, no requests, no caches.

Inputs are the tree and the target's output at every verified row: row 0 is the root (the last
committed token), row j + 1 is tree node j. Row r predicts the children of r.

Contract of the result:
- `accepted_nodes`: tree node indices of the accepted root-to-node path, in order;
- `next_token`: one token the target contributes after the path: the *bonus* token when the path
  could not go further because the node had no acceptable child, sampled from the target's own
  distribution at the last accepted row (for sampling: from the residual left after rejections).
The emitted tokens are `[tree.token_ids[j] for j in accepted_nodes] + [next_token]`.

Sampled verification is the multi-candidate form of speculative rejection sampling. At a row with
target distribution p, the children x_1..x_k are tried in index order; child i was drawn from q_i
(its row of `draft_probs`, or a point mass on x_i when the proposer is deterministic). Child i is
accepted with probability min(1, p(x_i) / q_i(x_i)); on rejection p becomes the residual
norm(max(p - q_i, 0)) and the next child is tried. If every child is rejected the next token is
drawn from the final residual. For one child this is the classic chain rule; with point masses it
offers tokens one at a time, so P(output = x) = p(x) exactly. Children with draft probabilities
must be independent draws from their rows.

Worked example (point masses, one row): p = {a: .5, b: .3, c: .2}, children [b, a]. b is kept with
probability .3; otherwise p becomes {a: 5/7, c: 2/7} and a is kept with probability 5/7, else c is
emitted: P(a) = .7 * 5/7 = .5, P(b) = .3, P(c) = .7 * 2/7 = .2.

Where every child of a row is a point mass (the weightless drafts: prompt lookup, suffix, n-gram,
datastore; and plain decoding, whose root has no children) the row is decided by coupling instead,
which has exactly the same distribution: the target's own token y is drawn from p with the row's
uniform u(position, 0), the child whose token is y is accepted, and if there is none y is the next
token. With `KeyedUniforms` (what the engine gives a request) u depends only on the request's seed
and the output position, so a seeded request's sampled output is plain sampling's, token for token,
whatever the draft proposed, however long the speculation was and however the step was batched;
the worked example: children [b, a], y = b with probability .3, a with .5, c with .2. Rows with
sampled children use u(position, 1 + i) for child i's test and u(position, 0) for the residual.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from specfleet.core.tree import DraftTree


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [vocab] distribution (not necessarily normalized) with the next uniform of `generator`."""
    return draw_at(probs, float(torch.rand((), generator=generator, dtype=torch.float64)))


def draw_at(probs: torch.Tensor, u: float) -> int:
    """The draw from a [vocab] distribution (not necessarily normalized) that the uniform u in [0, 1) picks.

    Inverse CDF in float64: the first index whose cumulative mass exceeds u * total. A token of zero
    mass adds nothing to the cumulative sum, so it can never be drawn. Why not torch.multinomial: on
    the CPU it took ~4.3 ms for one draw over a 151936-token vocabulary (this takes ~0.2 ms), paid by
    every sampled token of plain decoding, every sampled draft token and every verification's bonus or
    residual draw; and it cannot be given the uniform, which coupled verification needs."""
    cdf = probs.reshape(-1).to(torch.float64).cumsum(0)
    i = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True).item())
    if i < cdf.shape[0]:
        return i
    return int(torch.nonzero(probs.reshape(-1))[-1])  # u * total rounded up to total: the last token with mass


@dataclass(frozen=True)
class KeyedUniforms:
    """A request's uniforms as a function of (output position, index), not of how many were drawn before.

    u = the first 53 bits of BLAKE2b over (key, position, index), as a float in [0, 1). A counter-based
    draw, so the uniform that decides output position t is the same whether t is reached by plain
    decoding, by a verified tree of any shape, after a preemption or in a differently batched step;
    a seeded request (key = seed) therefore samples the same text every time. BLAKE2b (the standard
    library's) is a keyed hash whose output bits are indistinguishable from uniform; ~1 us a call."""
    key: int

    def __call__(self, position: int, index: int) -> float:
        h = hashlib.blake2b(f"{self.key}:{position}:{index}".encode(), digest_size=8).digest()
        return (int.from_bytes(h, "little") >> 11) * (1.0 / (1 << 53))


class StreamUniforms:
    """The next uniform of a torch generator, whatever the (position, index): for callers that keep one
    random stream (a draft's own draft-level verification; the unit tests' many trials on one generator)."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator

    def __call__(self, position: int, index: int) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))


@dataclass(frozen=True)
class VerifyResult:
    accepted_nodes: list[int]
    next_token: int

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    def emitted_tokens(self, tree: DraftTree) -> list[int]:
        return [tree.token_ids[j] for j in self.accepted_nodes] + [self.next_token]


def _children_table(tree: DraftTree) -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for j, p in enumerate(tree.parents):
        table.setdefault(p, []).append(j)
    return table


def verify_greedy(tree: DraftTree, target_argmax: list[int]) -> VerifyResult:
    """Follow the target's argmax (`target_argmax[r]` for row r) through the tree."""
    children = _children_table(tree)
    node, accepted = -1, []
    while True:
        want = target_argmax[node + 1]
        match = next((c for c in children.get(node, []) if tree.token_ids[c] == want), None)
        if match is None:
            return VerifyResult(accepted, want)
        accepted.append(match)
        node = match


def verify_sampled(tree: DraftTree, target_probs: torch.Tensor,
                   uniforms: KeyedUniforms | StreamUniforms | torch.Generator | None,
                   position: int = 0) -> VerifyResult:
    """Multi-candidate rejection sampling; `target_probs` is [num_nodes + 1, vocab] (see module doc).

    `position`: the output position the root's row decides (the request's tokens generated so far); the
    row of a node at depth d decides position + d. A torch generator (or None) is read as a stream."""
    if uniforms is None or isinstance(uniforms, torch.Generator):
        uniforms = StreamUniforms(uniforms)
    children = _children_table(tree)
    node, accepted = -1, []
    while True:
        row = target_probs[node + 1]
        kids = children.get(node, [])
        at = position + len(accepted)
        # each child's q(x): 1 for a point mass, whether or not the tree records draft rows
        q_xs = [1.0] * len(kids) if tree.draft_probs is None else \
            [float(tree.draft_probs[c][tree.token_ids[c]]) for c in kids]
        if all(q_x >= 1.0 for q_x in q_xs):
            # point masses only: coupling (module doc). y has p's distribution; accepting the child that
            # carries it keeps P(child x) = p(x) and leaves y to the residual otherwise
            y = draw_at(row, uniforms(at, 0))
            chosen = next((c for c in kids if tree.token_ids[c] == y), None)
            if chosen is None:
                return VerifyResult(accepted, y)
            accepted.append(chosen)
            node = chosen
            continue
        p = row.clone()
        chosen = None
        for i, (c, q_x) in enumerate(zip(kids, q_xs)):
            if q_x > 0 and uniforms(at, 1 + i) * q_x < float(p[tree.token_ids[c]]):
                chosen = c
                break
            # rejected: remove the proposal's mass from p
            p = (p - tree.draft_probs[c].to(p.device, torch.float32)).clamp_min_(0.0)
            total = float(p.sum())
            if total <= 0.0:  # p was entirely covered by q (only possible through rounding): keep the row
                p = row.clone()
                total = float(p.sum())
            p /= total
        if chosen is None:
            return VerifyResult(accepted, draw_at(p, uniforms(at, 0)))
        accepted.append(chosen)
        node = chosen
