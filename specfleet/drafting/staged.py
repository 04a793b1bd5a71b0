"""Staged speculation: the n-gram model speculates for the draft model, which speculates for the target.

A draft model's chain of k tokens normally costs k sequential draft forwards. Here each round the
n-gram model proposes a small tree below the chain so far, the draft model scores the whole tree in
one forward (tree mask, as the target does), and the draft's own verification keeps the longest
path it agrees with plus one token of its own. A round therefore adds 1 + accepted tokens, and a
chain needs as many rounds as the n-gram guesses badly.

The draft-level verification is the same pure code as the target's (core/verify.py), against the
draft's distribution q under the request's sampling settings:
- greedy: the draft's argmax path, so the chain is token for token the plain draft's chain;
- sampled: multi-candidate rejection sampling with the n-gram guesses as point masses, so every
  chain token is an exact draw from q at its position. The chain records those q rows as its
  draft_probs and the target verifies it like any sampled draft: lossless end to end.

Origins: tokens the n-gram proposed and the draft accepted are marked with the n-gram's name, the
draft's own tokens with the draft's name (then the target's corrections with "target"), which is
what `specfleet generate --show-origins` colours, as in the staged paper's Figure 3.

Worked example (greedy, k = 4): the chain is empty, the n-gram offers "( x )" below the last token;
the draft's argmax is "(" then "x" then ":": it keeps "( x" (ngram) and adds ":" (draft): 3 tokens
after one forward; the next round has k - 3 = 1 token left, so it is a plain draft step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specfleet.errors import InvalidRequestError
from specfleet.runtime.step.runner import tree_item
from specfleet.runtime.sample.sampling import GeneratorStore, target_probs
from specfleet.drafting.draft_model import DraftModelProposer
from specfleet.drafting.ngram_model import NgramModel
from specfleet.core.proposer import Feedback
from specfleet.core.tree import DraftTree
from specfleet.core.verify import verify_greedy, verify_sampled


@dataclass(frozen=True)
class StagedConfig:
    ngram_depth: int = 4  # deepest n-gram guess per round (capped by what the chain still needs)
    ngram_width: int = 2  # n-gram children per node
    ngram_nodes: int = 8  # n-gram nodes per round: extra tokens in one batched draft forward
    # a wrong guess costs only a slot in a draft forward that runs anyway, so guess liberally
    min_prob: float = 0.02
    learn_online: bool = True  # add prompts and committed tokens to the n-gram tables

    def validate(self) -> None:
        if self.ngram_depth < 1 or self.ngram_width < 1 or self.ngram_nodes < 1:
            raise InvalidRequestError("staged: ngram_depth, ngram_width and ngram_nodes must be >= 1")
        if not 0.0 <= self.min_prob <= 1.0:
            raise InvalidRequestError(f"staged: min_prob must be in [0, 1], got {self.min_prob}")


@dataclass
class _Chain:
    """One request's chain under construction."""

    req: object
    tokens: list[int]  # committed tokens + chain so far
    chain: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class StagedProposer:
    def __init__(self, draft: DraftModelProposer, ngram: NgramModel, config: StagedConfig | None = None,
                 ngram_name: str = "ngram"):
        if draft.config.top_children != 1:
            raise InvalidRequestError(f"{draft.name}+ngram drafts a chain; drop the tree width "
                                      f"(top_children={draft.config.top_children}) or the +ngram stage")
        self.config = config or StagedConfig()
        self.config.validate()
        self.draft = draft
        self.model = draft.model
        self.ngram = ngram
        self.ngram_name = ngram_name
        self.name = f"{draft.name}+{ngram_name}"
        self.generators = GeneratorStore(draft.device, salt=29)
        self.num_rounds = 0  # draft forwards, for the benchmarks: compare with k per chain
        self.num_chains = 0

    @property
    def num_speculative_tokens(self) -> int:
        return self.draft.num_speculative_tokens

    def set_num_speculative_tokens(self, n: int) -> None:
        self.draft.set_num_speculative_tokens(n)

    def propose(self, requests: list) -> dict[str, DraftTree]:
        k = self.draft.num_speculative_tokens
        limit = self.model.config.max_position_embeddings - k - self.config.ngram_nodes - 1
        states = []
        for r in requests:
            tokens = r.all_token_ids
            if self.config.learn_online:
                self.ngram.learn(r.request_id, tokens)
            if len(tokens) < limit:
                states.append(_Chain(r, tokens))
        try:
            active = states
            while active:
                active = self._round(active, k)
                self.num_rounds += 1
        finally:
            for s in states:  # roll the draft cache back to the committed tokens
                self.draft.rollback(s.req.request_id, s.req.num_tokens)
        out = {}
        for s in states:
            if s.chain:
                probs = torch.stack(s.probs) if s.probs else None
                out[s.req.request_id] = DraftTree(s.chain, list(range(-1, len(s.chain) - 1)), s.origins, probs)
                self.num_chains += 1
        return out

    def _round(self, states: list[_Chain], k: int) -> list[_Chain]:
        """One draft forward for every unfinished chain; returns the chains still unfinished."""
        cfg = self.config
        items, trees, ready = [], [], []
        for s in states:
            rid = s.req.request_id
            have = self.draft.num_cached_tokens(rid)
            if have >= len(s.tokens):  # the root is already cached (drafted twice in one step): refeed it
                have = len(s.tokens) - 1
                self.draft.rollback(rid, have)
            left = k - len(s.chain)
            tree = DraftTree()
            if left > 1:
                tree = self.ngram.propose_tree(s.tokens, min(cfg.ngram_depth, left - 1), cfg.ngram_width,
                                               cfg.ngram_nodes, cfg.min_prob, self.ngram_name)
            feed = s.tokens[have:]  # catch-up; its last token is the root the tree hangs from
            if not self.draft.reserve(rid, len(feed) + len(tree)):
                continue  # the draft cache is full: this chain stops where it is
            items.append(tree_item(rid, feed, have, tree))
            trees.append(tree)
            ready.append(s)
        if not items:
            return []
        logits = self.draft.forward(items)  # [sum of (1 + tree nodes), vocab]
        argmax = logits.argmax(-1).tolist()  # one host sync per round for every greedy request
        row, unfinished = 0, []
        for s, tree, item in zip(ready, trees, items):
            n = len(tree) + 1
            self._accept(s, tree, logits[row:row + n], argmax[row:row + n],
                         item.context_len + len(item.token_ids) - len(tree))
            row += n
            if len(s.chain) < k:
                unfinished.append(s)
            else:
                del s.chain[k:], s.origins[k:], s.probs[k:]
        return unfinished

    def _accept(self, s: _Chain, tree: DraftTree, rows: torch.Tensor, argmax: list[int], base: int) -> None:
        """Draft-level verification of one round, then keep the accepted path's KV (as the engine's
        commit does: compact the path to the front, truncate the rest). `base` = layout of node 0."""
        req = s.req
        if req.params.is_greedy:
            result = verify_greedy(tree, argmax)
        else:
            q = target_probs(rows, req.params)  # [1 + nodes, vocab]: the draft's distribution per row
            result = verify_sampled(tree, q, self.generators.get(req))
            # position i of the new tokens was decided at row 0 (the root) or at the previous node
            s.probs.extend(q[[0] + [j + 1 for j in result.accepted_nodes]])
        path = result.accepted_nodes
        new = [tree.token_ids[j] for j in path] + [result.next_token]
        s.chain.extend(new)
        s.tokens = s.tokens + new
        s.origins.extend([self.ngram_name] * len(path) + [self.draft.name])
        self.draft.commit_path(req.request_id, base, path)

    def observe(self, feedback: list[Feedback]) -> None:
        pass  # the draft cache was rolled back after drafting; tokens are learned at the next propose

    def release(self, request_id: str) -> None:
        self.draft.release(request_id)
        self.generators.pop(request_id)

    def free_kv(self, request_id: str) -> None:
        self.draft.free_kv(request_id)

    def prepare(self, requests: list) -> None:
        self.draft.prepare(requests)
