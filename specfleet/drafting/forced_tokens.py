"""The grammar draft: where a request's grammar forces the next text (a schema's keys and punctuation,
`", "`, a forced tool call's `<tool_call>\\n{"name": "get_weather", "arguments": `), that text is a draft
that costs no model call and that verification keeps whenever the target writes the forced text as the
tokenizer would (a model may, rarely, spell it in other tokens; verification then keeps the target's).

As a draft spec leaf, `grammar` (options: `k`, the most tokens per draft, default 16) drafts only for
requests with `structured_outputs`: `fleet(grammar,suffix,prompt-lookup)` lets the fleet weigh it
like any weightless member. The offline API and the server put it in front of the configured drafts
automatically (strategies/structured_front.py), which also cuts from the other drafts' trees the tokens
the grammar forbids and continues their leaves with the text the grammar forces after them.

State: one matcher per request, fed the request's committed tokens when it drafts (like prompt lookup,
it needs no feedback); dropped on release.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specfleet.core.proposer import Feedback, RequestView
from specfleet.core.tree import DraftTree
from specfleet.errors import InvalidRequestError
from specfleet.runtime.sample.structured import GrammarCompiler, Matcher

GRAMMAR_ORIGIN = "grammar"


@dataclass(frozen=True)
class GrammarDraftConfig:
    max_tokens: int = 16  # forced tokens drafted at most per step (and per leaf an extended tree gets)

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"grammar: k must be >= 1, got {self.max_tokens}")


class _State:
    def __init__(self, matcher: Matcher, num_prompt_tokens: int):
        self.matcher = matcher
        self.num_prompt_tokens = num_prompt_tokens


class ForcedTokensProposer:
    """Drafts the tokens a request's grammar forces (module docstring)."""

    def __init__(self, compiler: Callable[[], GrammarCompiler], config: GrammarDraftConfig | None = None,
                 name: str = GRAMMAR_ORIGIN):
        self.config = config or GrammarDraftConfig()
        self.config.validate()
        self.name = name
        self._compiler = compiler  # called on the first constrained request: building it takes seconds
        self._states: dict[str, _State] = {}
        self.num_drafted = 0

    # -- per-request state -----------------------------------------------------------------------
    def matcher(self, r: RequestView) -> Matcher | None:
        """The request's matcher, fed its committed tokens; None without a grammar (or a broken one)."""
        spec = r.params.structured_outputs
        if spec is None:
            return None
        st = self._states.get(r.request_id)
        if st is None:
            st = self._states[r.request_id] = _State(self._compiler().matcher(spec), len(r.prompt_token_ids))
        m = st.matcher
        tokens = r.all_token_ids
        m.advance(tokens[st.num_prompt_tokens + m.num_tokens:])
        return None if m.broken else m

    # -- protocol --------------------------------------------------------------------------------
    def propose(self, requests: list[RequestView]) -> dict[str, DraftTree]:
        out = {}
        for r in requests:
            m = self.matcher(r)
            if m is None:
                continue
            forced = m.forced_tokens(self.config.max_tokens)
            if forced:
                out[r.request_id] = DraftTree.chain(forced, self.name)
                self.num_drafted += len(forced)
        return out

    def observe(self, feedback: list[Feedback]) -> None:
        pass  # the matcher follows the request's committed tokens, which it reads when it drafts

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    # -- what the grammar front uses -------------------------------------------------------------
    def fit(self, r: RequestView, tree: DraftTree) -> tuple[DraftTree, list[int]] | None:
        """Another draft's point-mass tree with the grammar applied: nodes whose token the grammar forbids
        cut (with what is below them), each leaf continued by the tokens the grammar forces after it.
        Returns (tree, kept), `kept` the original indices of the tree's first len(kept) nodes (the rest
        are the grammar's), or None when nothing changed. Cutting a forbidden point-mass node changes no
        verification outcome (its masked probability is 0 either way); a tree with draft distributions is
        never cut, since whether a sampled token is cut would depend on the sample."""
        m = self.matcher(r)
        if m is None or tree.draft_probs is not None:
            return None
        children: dict[int, list[int]] = {}
        for j, p in enumerate(tree.parents):
            children.setdefault(p, []).append(j)
        kept: list[int] = []
        extensions: list[tuple[int, list[int]]] = []  # (original leaf index or -1, forced tokens after it)
        limit = self.config.max_tokens

        def visit(node: int) -> None:
            kids = [c for c in children.get(node, []) if m.allows(tree.token_ids[c])]
            for c in kids:
                kept.append(c)
                m.m.consume_token(tree.token_ids[c])
                try:
                    visit(c)
                finally:
                    m.m.rollback(1)
            if not kids and node >= 0:
                forced = m.forced_tokens(limit)
                if forced:
                    extensions.append((node, forced))

        visit(-1)
        if len(kept) == len(tree) and not extensions:
            return None
        kept.sort()
        base = tree.subtree(kept)
        index = {old: new for new, old in enumerate(kept)}
        tokens, parents, origins = list(base.token_ids), list(base.parents), list(base.origins)
        for leaf, forced in extensions:
            parent = index[leaf]
            for t in forced:
                tokens.append(t)
                parents.append(parent)
                origins.append(self.name)
                parent = len(tokens) - 1
        self.num_drafted += len(tokens) - len(kept)
        return DraftTree(tokens, parents, origins), kept

    def state(self) -> dict:
        return {"drafted": self.num_drafted}

