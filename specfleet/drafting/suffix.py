"""Suffix drafting (SuffixDecoding): draft trees from what followed the context's longest suffix.

No weights. Two suffix tries (suffix_tree.py) hold the text: one per request over its prompt and
output so far, updated with the committed tokens before each draft, and one shared by all requests
over the outputs of recent requests (stored when a request is released, the oldest evicted beyond
`global_nodes`). In each, the longest suffix of the request's context (up to `max_match` tokens) that
occurred before is found; what followed its occurrences, with their counts, is the candidate set.

The tree grows best first: a candidate's score is the product of the continuation frequencies on its
path (a frequency is a child's count over the counts of all its siblings), nodes below `min_prob`
are not proposed, and the node budget follows the match length, min(max_nodes, factor * match): a
long match has earned a deep guess, a short one a cautious guess (in the own text, a shorter match
is also tried when the longest one's continuation runs out early; see `_own_tree`). The two tries'
trees compete on their summed scores (the expected number of accepted tokens under the counts); a
match shorter than `min_match` in both gives no draft, so the request decodes plainly at no cost.

Example: in the context "x = f(a)\\ny = f(" the longest repeated suffix is " = f(", seen once before
and followed by "a", ")", "\\n" ..., each with frequency 1: the draft is the chain "a ) \\n ...", as
many tokens as the budget of that 3- or 4-token match allows.

Drafts are deterministic, so verification treats every node as a point mass (draft_probs None), as
for prompt lookup: lossless for greedy and sampled requests alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from specfleet.errors import InvalidRequestError
from specfleet.core.proposer import Feedback
from specfleet.drafting.suffix_tree import Cursor, SuffixTrie
from specfleet.core.tree import DraftTree, best_first_tree



@dataclass
class SuffixConfig:
    max_depth: int = 16  # deepest draft node (+adaptive lowers it at run time; never above this)
    max_nodes: int = 16  # node budget of a tree at its most confident
    factor: float = 1.0  # budget = min(max_nodes, factor * match length)
    max_match: int = 32  # longest suffix of the context that is matched
    min_match: int = 2  # shorter matches give no draft
    min_prob: float = 0.1  # nodes whose path frequency is below this are not proposed
    use_global: bool = True  # also match the outputs of other (earlier) requests
    global_nodes: int = 200_000  # size cap of the shared trie; the oldest outputs are evicted first

    def validate(self) -> None:
        problems = []
        if self.max_depth < 1 or self.max_nodes < 1:
            problems.append("max_depth and max_nodes must be >= 1")
        if not 1 <= self.min_match <= self.max_match:
            problems.append("need 1 <= min_match <= max_match")
        if self.factor <= 0:
            problems.append("factor must be > 0")
        if not 0.0 <= self.min_prob <= 1.0:
            problems.append("min_prob must be in [0, 1]")
        if self.global_nodes < 0:
            problems.append("global_nodes must be >= 0")
        if problems:
            raise InvalidRequestError(f"suffix: {'; '.join(problems)} (got {self})")


@dataclass
class _RequestState:
    trie: SuffixTrie
    num_prompt_tokens: int


def grow_tree(trie: SuffixTrie, cursor: Cursor, match_len: int, budget: int, max_depth: int, min_prob: float,
              origin: str) -> tuple[DraftTree, float]:
    """The best-first tree below `cursor` (a stored match of `match_len` tokens) and its summed score
    (core/tree.best_first_tree: a node's score is the product of the continuation frequencies on its path)."""
    return best_first_tree(lambda cur, depth: trie.continuations(cur, match_len + depth), cursor, budget, max_depth,
                           min_prob, origin)


class SuffixProposer:
    def __init__(self, config: SuffixConfig | None = None, name: str = "suffix"):
        self.config = config or SuffixConfig()
        self.config.validate()
        self.name = name
        self.depth = self.config.max_depth
        # deep enough to hold a full match plus the deepest continuation below it
        self.trie_depth = self.config.max_match + self.config.max_depth
        self.global_trie = SuffixTrie(self.trie_depth)
        self._requests: dict[str, _RequestState] = {}

    @property
    def num_speculative_tokens(self) -> int:
        return self.depth

    def set_num_speculative_tokens(self, n: int) -> None:
        """+adaptive sets the draft depth; the tries were sized for `max_depth`, so it caps the length."""
        self.depth = max(1, min(n, self.config.max_depth))

    def _state(self, req, tokens: list[int]) -> _RequestState:
        state = self._requests.get(req.request_id)
        if state is None:
            n_prompt = len(req.prompt_token_ids)
            state = _RequestState(SuffixTrie(self.trie_depth), n_prompt)
            state.trie.add(req.request_id, tokens)
            self._requests[req.request_id] = state
        else:
            seen = state.trie.num_tokens
            if len(tokens) > seen:  # committed tokens since the last draft (drafts never enter)
                state.trie.extend(req.request_id, tokens[seen:])
        return state

    def _budget(self, match_len: int) -> int:
        return min(self.config.max_nodes, max(1, math.floor(self.config.factor * match_len)))

    def _own_tree(self, trie: SuffixTrie) -> tuple[DraftTree | None, tuple[float, int]]:
        """The tree from the request's own text. In a loop of period p the longest repeat's one
        earlier occurrence ends p tokens back, so its continuation runs out after p tokens; a shorter
        match also reaches occurrences further back. So while the tree falls short of the budget
        (set by the longest match: that is the evidence), halve the match and keep the best."""
        cfg = self.config
        node, length = trie.longest_repeat(cfg.max_match)
        if length < cfg.min_match:
            return None, (0.0, 0)
        budget = self._budget(length)
        best, best_key = None, (0.0, 0)
        while True:
            tree, score = grow_tree(trie, (node, -1), length, budget, self.depth, cfg.min_prob, self.name)
            if len(tree) and (score, length) > best_key:
                best, best_key = tree, (score, length)
            if len(tree) >= budget or length // 2 < cfg.min_match:
                return best, best_key
            node, length = trie.longest_repeat(length // 2)

    def propose(self, requests: list) -> dict[str, DraftTree]:
        cfg = self.config
        trees = {}
        for req in requests:
            tokens = req.all_token_ids
            best, best_key = self._own_tree(self._state(req, tokens).trie)
            if cfg.use_global and self.global_trie.num_nodes:
                cursor, length = self.global_trie.longest_match(tokens, cfg.min_match, cfg.max_match)
                if cursor is not None:
                    tree, score = grow_tree(self.global_trie, cursor, length, self._budget(length), self.depth,
                                            cfg.min_prob, self.name)
                    if len(tree) and (score, length) > best_key:  # the own context wins ties
                        best = tree
            if best is not None:
                trees[req.request_id] = best
        return trees

    def observe(self, feedback: list[Feedback]) -> None:
        pass  # committed tokens are read from the request at its next draft

    def release(self, request_id: str) -> None:
        """The request's output joins the shared trie (replacing what an earlier preemption stored)."""
        state = self._requests.pop(request_id, None)
        if state is None or not self.config.use_global:
            return
        output = state.trie.sequences[request_id][state.num_prompt_tokens:]
        if len(output) > 1:
            self.global_trie.add(request_id, output)
            self.global_trie.evict_to(self.config.global_nodes, keep=request_id)
            if self.global_trie.num_nodes > self.config.global_nodes:  # one output alone is over the cap
                self.global_trie.remove(request_id)
