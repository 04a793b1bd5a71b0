"""Prompt lookup: draft by copying what followed an earlier occurrence of the request's last n tokens.

No weights: the request's own prompt and output are the model. Code, extraction and chat that quote
their context accept long runs of these drafts. With `num_branches` > 1 the distinct continuations
of several earlier matches become sibling branches of a tree.

Example: tokens "a b c d a b" with max_ngram 2 match the suffix "a b" at position 0, so the draft is
"c d a ..." (up to `num_speculative_tokens`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from specfleet.core.proposer import Feedback, RequestView, register
from specfleet.core.tree import DraftTree


@dataclass
class PromptLookupConfig:
    num_speculative_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    num_branches: int = 1  # > 1 builds a tree from several matches

    def validate(self) -> None:
        from specfleet.errors import InvalidRequestError
        if self.num_speculative_tokens < 1 or not 1 <= self.min_ngram <= self.max_ngram or self.num_branches < 1:
            raise InvalidRequestError(f"invalid prompt-lookup settings {self}")


def find_continuations(tokens: list[int], cfg: PromptLookupConfig) -> list[list[int]]:
    """Up to `num_branches` distinct continuations, the most recent and longest match first."""
    found: list[list[int]] = []
    n_tok = len(tokens)
    for n in range(min(cfg.max_ngram, n_tok - 1), cfg.min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        for start in range(n_tok - n - 1, -1, -1):  # most recent occurrence first, not the suffix itself
            if tokens[start:start + n] == suffix:
                cont = tokens[start + n:start + n + cfg.num_speculative_tokens]
                if cont and all(cont[0] != f[0] for f in found):
                    found.append(cont)
                    if len(found) == cfg.num_branches:
                        return found
        if found:
            return found
    return found


def tree_from_sequences(seqs: list[list[int]], origin: str) -> DraftTree:
    """Merge token sequences into a prefix tree (shared prefixes become one path)."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for seq in seqs:
        parent = -1
        for tok in seq:
            node = index.get((parent, tok))
            if node is None:
                node = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                index[(parent, tok)] = node
            parent = node
    return DraftTree(tokens, parents, [origin] * len(tokens))


class PromptLookupProposer:
    def __init__(self, config: PromptLookupConfig | None = None, name: str = "prompt-lookup"):
        self.config = config or PromptLookupConfig()
        self.config.validate()
        self.name = name

    def propose(self, requests: list[RequestView]) -> dict[str, DraftTree]:
        trees = {}
        for req in requests:
            conts = find_continuations(req.all_token_ids, self.config)
            if conts:
                trees[req.request_id] = tree_from_sequences(conts, self.name)
        return trees

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def set_num_speculative_tokens(self, n: int) -> None:
        self.config = replace(self.config, num_speculative_tokens=n)

    def observe(self, feedback: list[Feedback]) -> None:
        pass  # stateless: the request's tokens are its whole state

    def release(self, request_id: str) -> None:
        pass


@register("prompt-lookup")
def _make_prompt_lookup(num_speculative_tokens: int = 4, num_branches: int = 1, **kw) -> PromptLookupProposer:
    return PromptLookupProposer(PromptLookupConfig(num_speculative_tokens=num_speculative_tokens,
                                                   num_branches=num_branches, **kw))
