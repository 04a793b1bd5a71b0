"""The grammar draft in front of the configured drafts, for requests with a grammar.

For a request with `structured_outputs`, every step:
1. where the grammar forces the next tokens, those are the draft (drafting/forced_tokens.py): no model
   is called and the configured drafts are not asked for this request this step;
2. else the configured drafts draft as usual; a point-mass tree then loses the nodes the grammar forbids
   (they could never be accepted) and each of its leaves is continued by the tokens the grammar forces
   after it (a drafted value's closing quote, then `, "next_key": `). The configured drafts get their
   feedback on their own tree (the accepted path mapped back, the committed tokens as they are).
Requests without a grammar go to the configured drafts untouched: the wrapper changes nothing for them.

Transparent: the wrapper keeps the configured proposer's name, and its capabilities (speculation
length, draft KV, weights, state) are the configured proposer's, read through; `inner` is the configured
proposer and `children` both.
"""
from __future__ import annotations

from specfleet.core.proposer import Feedback, Proposer, RequestView
from specfleet.core.tree import DraftTree
from specfleet.drafting.forced_tokens import ForcedTokensProposer


class GrammarFront:
    def __init__(self, grammar: ForcedTokensProposer, inner: Proposer):
        self.grammar = grammar
        self.inner = inner
        self.children = [grammar, inner]
        self.name = inner.name
        self._forced: set[str] = set()  # requests whose draft this step is the grammar's alone
        self._kept: dict[str, tuple[DraftTree, list[int]]] = {}  # request -> (inner's tree, nodes kept)

    def __getattr__(self, name: str):
        if name in ("grammar", "inner", "children", "_forced", "_kept"):  # before __init__ ran
            raise AttributeError(name)
        return getattr(self.inner, name)  # the configured proposer's capabilities, read through

    def propose(self, requests: list[RequestView]) -> dict[str, DraftTree]:
        constrained = [r for r in requests if r.params.structured_outputs is not None]
        if not constrained:
            return self.inner.propose(requests)
        for r in requests:  # a request drafts again only once its last draft was verified (or dropped)
            self._forced.discard(r.request_id)
            self._kept.pop(r.request_id, None)
        forced = self.grammar.propose(constrained)
        self._forced.update(forced)
        rest = [r for r in requests if r.request_id not in forced]
        trees = self.inner.propose(rest) if rest else {}
        for r in rest:
            tree = trees.get(r.request_id)
            if tree is None or r.params.structured_outputs is None:
                continue
            fitted = self.grammar.fit(r, tree)
            if fitted is not None:
                trees[r.request_id] = fitted[0]
                self._kept[r.request_id] = (tree, fitted[1])
        trees.update(forced)
        return {rid: t for rid, t in trees.items() if len(t)}

    def observe(self, feedback: list[Feedback]) -> None:
        mine = []
        for fb in feedback:
            if fb.request_id in self._forced:
                self._forced.discard(fb.request_id)
                continue  # the configured drafts drafted nothing for it this step
            kept = self._kept.pop(fb.request_id, None)
            if kept is not None:
                tree, index = kept
                fb = Feedback(fb.request_id, tree, [index[j] for j in fb.accepted_nodes if j < len(index)],
                              fb.num_emitted, fb.verify_time, fb.emitted_token_ids)
            mine.append(fb)
        if mine:
            self.inner.observe(mine)

    def release(self, request_id: str) -> None:
        self._forced.discard(request_id)
        self._kept.pop(request_id, None)
        self.grammar.release(request_id)
        self.inner.release(request_id)


def structured_front(proposer: Proposer | None, grammar: ForcedTokensProposer) -> Proposer | None:
    """`proposer` with the grammar draft in front (None stays None: no drafts means no speculation)."""
    if proposer is None or isinstance(proposer, GrammarFront):
        return proposer
    return GrammarFront(grammar, proposer)
