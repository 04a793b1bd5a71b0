"""Tree arithmetic of the fleet (strategies/fleet.py): trimming a candidate to its node set of best
expected tokens per cost, and the Minions-style union of point-mass trees with path probabilities."""
from __future__ import annotations

from specfleet.core.tree import DraftTree


def ranked(probs: list[float]) -> tuple[list[int], list[float]]:
    """(nodes by path probability, highest first, ties in tree order; E[tokens] when the first m of them are
    verified, m = 0..len). Every prefix of the order is closed under ancestors (a child's path probability never
    exceeds its parent's, and a parent comes first in the tree), so the first m are the best m-node subtree."""
    order = sorted(range(len(probs)), key=lambda j: (-probs[j], j))
    expected = [1.0]
    for j in order:
        expected.append(expected[-1] + probs[j])
    return order, expected


def best_subtree(probs: list[float], fixed: float, extra) -> tuple[list[int], float, float]:
    """(nodes, E[tokens], cost) of the ancestor-closed node set of best E / cost, where verifying m
    nodes costs fixed + extra(m); the empty set (plain decoding) included."""
    order, expected = ranked(probs)
    best = (0, 1.0, fixed)
    for m in range(1, len(order) + 1):
        cost = fixed + extra(m)
        if expected[m] * best[2] > best[1] * cost:
            best = (m, expected[m], cost)
    return sorted(order[:best[0]]), best[1], best[2]


def merge_trees(trees: list[DraftTree], probs: list[list[float]]) -> tuple[DraftTree, list[float]]:
    """The prefix-tree union of point-mass trees and its nodes' path probabilities: a node's conditional
    acceptance is the best of its sources', and where a parent's children's add up to more than 1 they are
    scaled to sum to 1 (strategies/fleet.py, step 1)."""
    tokens, parents, origins, cond = [], [], [], []
    index: dict[tuple[int, int], int] = {}
    for tree, p in zip(trees, probs):
        mine: list[int] = []
        for j, (par, tok) in enumerate(zip(tree.parents, tree.token_ids)):
            mp = mine[par] if par >= 0 else -1
            a = p[j] / p[par] if par >= 0 and p[par] > 0 else (p[j] if par < 0 else 0.0)
            node = index.get((mp, tok))
            if node is None:
                node = index[(mp, tok)] = len(tokens)
                tokens.append(tok), parents.append(mp), origins.append(tree.origins[j]), cond.append(a)
            else:
                cond[node] = max(cond[node], a)
            mine.append(node)
    sums: dict[int, float] = {}
    for par, a in zip(parents, cond):
        sums[par] = sums.get(par, 0.0) + a
    path: list[float] = []
    for j, par in enumerate(parents):
        a = cond[j] / max(sums[par], 1.0)
        path.append((path[par] if par >= 0 else 1.0) * a)
    return DraftTree(tokens, parents, origins), path
