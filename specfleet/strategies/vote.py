"""Minions' majority-voted speculation: several proposers draft, a weighted vote picks one sequence.

Every child proposer drafts for the request. Their sequences merge into a prefix tree in which a
node's weight is the sum of the weights of the proposers whose sequence passes through it. From the
root the heaviest child is taken at each level down to a leaf, so the result is one real proposer's
sequence (the "voted" proposer's), and only that sequence is verified: voting costs the target
nothing extra.

Ties: on equal weight the child created first wins, i.e. the one on the sequence of the earliest
listed proposer among those passing through the tied children; among identical sequences the
earliest listed proposer is the voted one. So at equal weights the first listed draft leads.

Worked example (weights A = 1, B = 1, C = 1.5): A = "x y", B = "x z", C = "w". Level 1: "x" weighs
A + B = 2 > "w" = 1.5, so "x"; level 2: "y" and "z" tie at 1, "y" was created first (A is listed
first), so A's "x y" is verified and A is the voted proposer.

Learning (Minions' speculation quality metric): after a verification batch, each proposer's average
acceptance rate (accepted / drafted) over the requests it won in that batch is compared with
`reward_threshold` and `punish_threshold`, and its weight multiplied by `reward_factor` or
`punish_factor`; weights are clamped to [min_weight, max_weight] so no proposer becomes unbeatable
or unrecoverable.

Sampling: a child's sampled chain carries its draft distributions, but the vote chooses a chain
*because of* its tokens (agreement with the others), so the chosen chain is no longer a plain draw
from those distributions and rejection sampling against them would be biased. Two lossless modes
(`sampled`): "heaviest" (default) gives a sampled request the chain of the heaviest voter that
drafted, chosen by the weights alone (which depend only on past verifications), and keeps its
distributions, so acceptance stays that of rejection sampling; "vote" votes as for greedy requests
and verifies the chain as point masses (accepted with probability p(x) rather than min(1, p/q),
which is far lower for flat distributions). Greedy requests are always voted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from specfleet.errors import InvalidRequestError
from specfleet.core.proposer import prepare_kv, set_speculation_length, speculation_length, Feedback, Proposer
from specfleet.core.tree import DraftTree


@dataclass(frozen=True)
class VoteConfig:
    initial_weight: float = 1.0  # every proposer starts equal (ties go to the first listed)
    reward_threshold: float = 0.6  # average acceptance above this earns a reward
    punish_threshold: float = 0.3  # average acceptance below this earns a punishment
    reward_factor: float = 1.1
    punish_factor: float = 0.9
    min_weight: float = 1e-3
    max_weight: float = 1e3
    sampled: str = "heaviest"  # how sampled requests choose a chain: "heaviest" or "vote" (see above)

    def validate(self) -> None:
        if not 0.0 <= self.punish_threshold <= self.reward_threshold <= 1.0:
            raise InvalidRequestError(f"vote: need 0 <= punish_threshold <= reward_threshold <= 1, got "
                                      f"{self.punish_threshold}, {self.reward_threshold}")
        if self.reward_factor < 1.0 or not 0.0 < self.punish_factor <= 1.0:
            raise InvalidRequestError(f"vote: need reward_factor >= 1 and 0 < punish_factor <= 1, got "
                                      f"{self.reward_factor}, {self.punish_factor}")
        if self.sampled not in ("heaviest", "vote"):
            raise InvalidRequestError(f"vote: sampled must be 'heaviest' or 'vote', got {self.sampled!r}")
        if not 0.0 < self.min_weight <= self.initial_weight <= self.max_weight:
            raise InvalidRequestError("vote: need 0 < min_weight <= initial_weight <= max_weight")


def first_path(tree: DraftTree) -> list[int]:
    """A proposer's own best sequence: its first child at every level (chains: all nodes)."""
    if tree.is_chain:
        return list(range(len(tree)))
    first: dict[int, int] = {}
    for j, p in enumerate(tree.parents):
        first.setdefault(p, j)
    path, node = [], -1
    while node in first:
        node = first[node]
        path.append(node)
    return path


def weighted_vote(sequences: list[list[int]], weights: list[float]) -> int:
    """Index of the voted sequence (see the module docstring for the rule and its ties)."""
    children: dict[int, list[int]] = {-1: []}  # node -> child nodes in creation order
    node_weight: list[float] = []
    ends: dict[int, int] = {}  # node -> first listed sequence ending there
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for i, (seq, w) in enumerate(zip(sequences, weights)):
        parent = -1
        for tok in seq:
            node = index.get((parent, tok))
            if node is None:
                node = index[(parent, tok)] = len(node_weight)
                node_weight.append(0.0)
                children[parent].append(node)
                children[node] = []
            node_weight[node] += w
            parent = node
        ends.setdefault(parent, i)
    node = -1
    while children[node]:
        best = children[node][0]
        for c in children[node][1:]:
            if node_weight[c] > node_weight[best]:  # strict: the earlier child keeps a tie
                best = c
        node = best
    return ends[node]


class VoteProposer:
    def __init__(self, children: list[Proposer], config: VoteConfig | None = None, name: str | None = None):
        names = [c.name for c in children]
        if len(children) < 2:
            raise InvalidRequestError("vote(...) needs at least two drafts to vote between")
        if len(set(names)) != len(names):
            raise InvalidRequestError(f"vote(...) lists a draft twice: {names}; each voter needs its own name")
        self.config = config or VoteConfig()
        self.config.validate()
        self.children = list(children)
        self.name = name or f"vote({','.join(names)})"
        self._weights = [self.config.initial_weight] * len(children)
        self._voted: dict[str, int] = {}  # request id -> child whose chain is out for verification
        self._dropped: set[str] = set()  # released requests, forgotten after the next observe
        self.wins = [0] * len(children)
        self._stats = [{"drafted": 0, "accepted": 0} for _ in children]
        self.overhead_s = {"vote": 0.0, "weight_update": 0.0}

    @property
    def weights(self) -> dict[str, float]:
        """Voter name -> weight (the server's /metrics shows these)."""
        return {c.name: w for c, w in zip(self.children, self._weights)}

    @property
    def draft_stats(self) -> dict[str, dict]:
        """Voter name -> drafted / accepted tokens over the drafts it won."""
        return {c.name: dict(s) for c, s in zip(self.children, self._stats)}

    def propose(self, requests: list) -> dict[str, DraftTree]:
        drafts = [c.propose(requests) for c in self.children]
        t0 = time.perf_counter()
        out: dict[str, DraftTree] = {}
        for req in requests:
            rid = req.request_id
            cands = [(i, d[rid]) for i, d in enumerate(drafts) if rid in d and len(d[rid])]
            if not cands:
                continue
            paths = [first_path(t) for _, t in cands]
            seqs = [[t.token_ids[j] for j in p] for (_, t), p in zip(cands, paths)]
            weights = [self._weights[i] for i, _ in cands]
            # independent of this step's samples: the winner's draft distributions stay valid
            by_weight = not req.params.is_greedy and self.config.sampled == "heaviest"
            k = weights.index(max(weights)) if by_weight else weighted_vote(seqs, weights)
            winner, tree = cands[k]
            path = paths[k]
            keep_probs = tree.draft_probs is not None and (by_weight or len(cands) == 1)
            probs = tree.draft_probs[path] if keep_probs else None
            out[rid] = DraftTree(seqs[k], list(range(-1, len(path) - 1)), [tree.origins[j] for j in path], probs)
            self._voted[rid] = winner
            self.wins[winner] += 1
        self.overhead_s["vote"] += time.perf_counter() - t0
        return out

    def observe(self, feedback: list[Feedback]) -> None:
        t0 = time.perf_counter()
        rates: dict[int, list[float]] = {}
        routed: dict[int, list[Feedback]] = {}
        for fb in feedback:
            winner = self._voted.pop(fb.request_id, None)
            if winner is None or not len(fb.tree):
                continue
            rates.setdefault(winner, []).append(fb.num_accepted / len(fb.tree))
            self._stats[winner]["drafted"] += len(fb.tree)
            self._stats[winner]["accepted"] += fb.num_accepted
            routed.setdefault(winner, []).append(fb)
        for rid in self._dropped:
            self._voted.pop(rid, None)
        self._dropped.clear()
        self.update_weights(rates)
        self.overhead_s["weight_update"] += time.perf_counter() - t0
        for i, fbs in routed.items():  # a child learns only from the drafts it won
            self.children[i].observe(fbs)

    def update_weights(self, rates: dict[int, list[float]]) -> None:
        """Minions' rule: per child, the mean acceptance rate of this batch's won drafts."""
        cfg = self.config
        for i, rs in rates.items():
            acr = sum(rs) / len(rs)
            if acr > cfg.reward_threshold:
                self._weights[i] = min(self._weights[i] * cfg.reward_factor, cfg.max_weight)
            elif acr < cfg.punish_threshold:
                self._weights[i] = max(self._weights[i] * cfg.punish_factor, cfg.min_weight)

    def release(self, request_id: str) -> None:
        # the engine releases a request that just finished before it reports that last step, so its
        # voted entry is kept until the next observe has used it
        self._dropped.add(request_id)
        for c in self.children:
            c.release(request_id)

    @property
    def num_speculative_tokens(self) -> int:
        """The deepest voter's length (a voter without a length, such as a plugin, does not count)."""
        return max((n for n in map(speculation_length, self.children) if n is not None), default=0)

    def set_num_speculative_tokens(self, n: int) -> None:
        for c in self.children:
            set_speculation_length(c, n)

    def prepare(self, requests: list) -> None:
        for c in self.children:
            prepare_kv(c, requests)

    def state(self) -> dict:
        return {"weights": {k: round(v, 4) for k, v in self.weights.items()},
                "overhead_s": {k: round(v, 6) for k, v in self.overhead_s.items()}}
