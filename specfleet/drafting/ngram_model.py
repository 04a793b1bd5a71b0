"""A backoff n-gram model over token ids: the cheap "draft of the draft" of staged speculation.

Tables of counts for every order up to `order` (trigram, bigram, unigram by default). A query takes
the longest context the tables know well enough (seen at least `min_count` times) and falls back one
order at a time, down to the unigram table (the staged-speculation paper uses a Katz backoff
trigram; we keep the backoff order and skip the discounting, since only the ranking of the
candidates and a rough confidence are used).

Worked example, order 3, trained on "a b c a b d a b c": the context (a, b) was followed by c twice
and d once, so after "... a b" the model offers c (2/3), then d (1/3). After "... x b" the trigram
context (x, b) is unknown, so it backs off to the bigram context (b,) with the same counts, and
after an unknown token to the unigram table (a: 3, b: 3, c: 2, d: 1).

Memory: learning online counts every prompt and committed token, about 240 bytes per new table entry
and up to `order` new entries per token, for as long as the server runs. `max_entries` bounds it as
the suffix trie's node cap does (drafting/suffix_tree.py): beyond it the tokens learned longest ago
are forgotten (their counts taken back, entries that reach zero removed), requests least recently
learned first and each from its first token on, so the tables describe the most recent stream. The
same bound caps the learned tokens the model keeps to take counts back (`_Learned`). Tables built
with `add` (`specfleet ngram build`) or loaded from a file are not learned, so never forgotten, and
the bound counts the entries learning adds beyond them.

`propose_tree` expands the best-first tree (by cumulative probability, like the draft model's tree)
that NgramProposer sends to the target and StagedProposer sends to the draft model.

Tables are saved as JSON (gzip when the path ends in .gz): {"format": "specfleet-ngram", "version":
1, "order": N, "tables": {"1": [[next, count], ...], "2": [[a, next, count], ...], ...}}.
"""
from __future__ import annotations

import gzip
import heapq
import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from specfleet.errors import InvalidRequestError
from specfleet.core.tree import DraftTree

FORMAT = "specfleet-ngram"
MAX_TRACKED = 10_000  # requests whose counted length is remembered
# About 240 bytes an entry (tracemalloc, the kept learned tokens included): 250k entries take ~60 MB and
# hold the last ~100k tokens of fresh text at order 3 (2.4 new entries a token); a repetitive stream reuses
# its entries, and then the last 250k tokens are what the tables count.
DEFAULT_MAX_ENTRIES = 250_000


@dataclass(frozen=True)
class NgramConfig:
    order: int = 3  # longest n-gram: 3 = trigram -> bigram -> unigram
    min_count: int = 1  # a context seen fewer times than this is skipped in favour of a shorter one
    num_speculative_tokens: int = 4  # depth of the proposed tree
    top_children: int = 1  # children per expanded node; 1 = a chain
    max_nodes: int = 8  # node budget of the proposed tree
    # nodes whose cumulative n-gram probability falls below this are not proposed: a weightless model
    # should not spend the target's verification slots on guesses it does not believe itself
    min_prob: float = 0.1
    learn_online: bool = True  # add every prompt and committed token to the tables as they arrive
    path: str | None = None  # tables to load at start (built by `specfleet ngram build`)
    max_entries: int = DEFAULT_MAX_ENTRIES  # bound on the tables and learned tokens (the module doc's Memory)

    def validate(self) -> None:
        if self.order < 1 or self.min_count < 1:
            raise InvalidRequestError(f"ngram: order and min_count must be >= 1, got {self.order}, {self.min_count}")
        if self.max_entries < 1:
            raise InvalidRequestError(f"ngram: max_entries must be >= 1, got {self.max_entries}")
        if self.num_speculative_tokens < 1 or self.top_children < 1 or self.max_nodes < 1:
            raise InvalidRequestError("ngram: num_speculative_tokens, top_children and max_nodes must be >= 1")
        if not 0.0 <= self.min_prob <= 1.0:
            raise InvalidRequestError(f"ngram: min_prob must be in [0, 1], got {self.min_prob}")


class _Learned:
    """What a request taught the tables: its tokens from `first` (the oldest still counted) to `end`
    (counted so far), kept with the order - 1 tokens before `first` that its n-grams need as context,
    so the counts can be taken back."""

    __slots__ = ("tokens", "first", "end")

    def __init__(self):
        self.tokens: deque[int] = deque()  # positions first - len(context) .. end - 1
        self.first = 0
        self.end = 0

    @property
    def num_counted(self) -> int:
        return self.end - self.first


class NgramModel:
    def __init__(self, order: int = 3, min_count: int = 1, max_entries: int = DEFAULT_MAX_ENTRIES):
        if order < 1 or min_count < 1 or max_entries < 1:
            raise InvalidRequestError(f"an n-gram model needs order, min_count and max_entries >= 1, got {order}, "
                                      f"{min_count}, {max_entries}")
        self.order = order
        self.min_count = min_count
        self.max_entries = max_entries
        # tables[n - 1][context of n - 1 tokens][next token] = count
        self.tables: list[dict[tuple[int, ...], dict[int, int]]] = [{} for _ in range(order)]
        self.totals: list[dict[tuple[int, ...], int]] = [{} for _ in range(order)]
        self.num_entries = 0  # (context, next token) pairs in the tables
        self._ranked: dict[tuple[int, tuple[int, ...]], list[tuple[int, float]]] = {}  # cache of sorted rows
        # request id -> what it taught, least recently learned first. Kept past a request's release (a
        # preempted request comes back under its id and must not be counted twice) until its counts are
        # forgotten (see the module doc's Memory), or beyond MAX_TRACKED requests; one per model, so
        # every proposer sharing the tables counts a request once
        self._learned: dict[str, _Learned] = {}
        self.num_learned_tokens = 0  # sum of num_counted over _learned
        # entries the tables had when online learning began (built or loaded): max_entries comes on top
        self._base_entries: int | None = None

    # -- learning --------------------------------------------------------------------------------
    def add(self, tokens: list[int], start: int = 0) -> None:
        """Count every n-gram that ends at a position >= `start` (so a growing sequence can be added
        piece by piece without counting anything twice)."""
        for i in range(max(start, 0), len(tokens)):
            nxt = tokens[i]
            for n in range(1, self.order + 1):
                if i - (n - 1) < 0:
                    break
                self._count(n, tuple(tokens[i - n + 1:i]), nxt, 1)

    def _count(self, n: int, ctx: tuple[int, ...], nxt: int, delta: int) -> None:
        """Add `delta` to the count of `nxt` after `ctx` in the order-n table; a count of zero goes."""
        table, totals = self.tables[n - 1], self.totals[n - 1]
        row = table.setdefault(ctx, {})
        count = row.get(nxt, 0) + delta
        if count > 0:
            self.num_entries += nxt not in row
            row[nxt] = count
        elif nxt in row:
            del row[nxt]
            self.num_entries -= 1
        total = totals.get(ctx, 0) + delta
        if total > 0:
            totals[ctx] = total
        else:
            totals.pop(ctx, None)
            table.pop(ctx, None)
        self._ranked.pop((n, ctx), None)

    def learn(self, request_id: str, tokens: list[int]) -> None:
        """Count a request's tokens that were not counted before (call it as the request grows), then
        forget the oldest learned tokens while the tables are over `max_entries`."""
        if self._base_entries is None:
            self._base_entries = self.num_entries
        learned = self._learned.pop(request_id, None) or _Learned()  # re-inserted below: most recent last
        self._learned[request_id] = learned
        if learned.end < len(tokens):
            self.add(tokens, learned.end)
            learned.tokens.extend(tokens[learned.end:])
            self.num_learned_tokens += len(tokens) - learned.end
            learned.end = len(tokens)
        while len(self._learned) > MAX_TRACKED:
            self._forget_all(next(iter(self._learned)))
        self._evict(request_id)

    def _evict(self, keep: str) -> None:
        """Forget the oldest learned tokens until the tables and the kept tokens fit `max_entries`:
        requests least recently learned first, each from its first token on. `keep` (the request just
        learned) keeps its record, so a request longer than the bound is forgotten from its start on,
        as a sliding window, and never counted again from zero."""
        while self.num_entries > self._base_entries + self.max_entries or self.num_learned_tokens > self.max_entries:
            request_id, learned = next(iter(self._learned.items()))
            if learned.num_counted == 0:
                if request_id == keep:  # only unlearnable (built or loaded) entries are left
                    return
                del self._learned[request_id]
                continue
            self._forget_first(learned)

    def _forget_all(self, request_id: str) -> None:
        learned = self._learned.pop(request_id)
        while learned.num_counted:
            self._forget_first(learned)

    def _forget_first(self, learned: _Learned) -> None:
        """Take back the counts of the n-grams ending at the request's oldest counted token."""
        toks = learned.tokens
        c = len(toks) - learned.num_counted  # context tokens kept before it (order - 1 once there are enough)
        nxt = toks[c]
        for n in range(1, min(self.order, c + 1) + 1):
            self._count(n, tuple(toks[j] for j in range(c - n + 1, c)), nxt, -1)
        learned.first += 1
        self.num_learned_tokens -= 1
        if c == self.order - 1:
            toks.popleft()

    # -- queries ---------------------------------------------------------------------------------
    def backoff_order(self, context: list[int]) -> int:
        """The order whose table answers for `context` (0 when the model is empty)."""
        for n in range(min(self.order, len(context) + 1), 0, -1):
            ctx = tuple(context[len(context) - n + 1:]) if n > 1 else ()
            if self.totals[n - 1].get(ctx, 0) >= (self.min_count if n > 1 else 1):
                return n
        return 0

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        """Up to k (token, probability) pairs from the backoff table, most likely first (ties: lower id)."""
        n = self.backoff_order(context)
        if n == 0:
            return []
        ctx = tuple(context[len(context) - n + 1:]) if n > 1 else ()
        ranked = self._ranked.get((n, ctx))
        if ranked is None or len(ranked) < k and len(ranked) < len(self.tables[n - 1][ctx]):
            total = self.totals[n - 1][ctx]
            row = self.tables[n - 1][ctx]
            top = heapq.nsmallest(max(k, 4), row.items(), key=lambda kv: (-kv[1], kv[0]))
            ranked = [(tok, c / total) for tok, c in top]
            self._ranked[(n, ctx)] = ranked
        return ranked[:k]

    def propose_tree(self, context: list[int], depth: int, width: int, max_nodes: int, min_prob: float,
                     origin: str) -> DraftTree:
        """Best-first tree under `context`: repeatedly add the candidate of highest cumulative
        probability (children of a node are offered once it is added), so parents precede children."""
        context = list(context[max(0, len(context) - (self.order - 1)):]) if self.order > 1 else []
        tokens: list[int] = []
        parents: list[int] = []
        paths: list[list[int]] = []
        heap: list[tuple[float, int, int, int]] = []  # (-score, tie, parent, token)
        tie = 0

        def offer(parent: int, score: float) -> None:
            nonlocal tie
            path = paths[parent] if parent >= 0 else []
            for tok, p in self.candidates(context + path, width):
                if score * p >= min_prob:
                    heapq.heappush(heap, (-score * p, tie, parent, tok))
                    tie += 1

        offer(-1, 1.0)
        while heap and len(tokens) < max_nodes:
            neg, _, parent, tok = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            paths.append((paths[parent] if parent >= 0 else []) + [tok])
            if len(paths[-1]) < depth:
                offer(len(tokens) - 1, -neg)
        return DraftTree(tokens, parents, [origin] * len(tokens))

    # -- files -----------------------------------------------------------------------------------
    def save(self, path: str | Path, min_count: int = 1) -> None:
        """Write the tables; entries counted fewer than `min_count` times are pruned from the file."""
        tables = {str(n + 1): [[*ctx, tok, c] for ctx, row in t.items() for tok, c in row.items() if c >= min_count]
                  for n, t in enumerate(self.tables)}
        doc = {"format": FORMAT, "version": 1, "order": self.order, "tables": tables}
        data = json.dumps(doc, separators=(",", ":")).encode()
        path = Path(path)
        path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)

    @classmethod
    def load(cls, path: str | Path, min_count: int = 1, max_entries: int = DEFAULT_MAX_ENTRIES) -> "NgramModel":
        path = Path(path)
        try:
            raw = path.read_bytes()
            doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
        except OSError as e:
            raise InvalidRequestError(f"cannot read n-gram tables {str(path)!r}: {e.strerror}") from e
        except (ValueError, EOFError) as e:
            raise InvalidRequestError(f"{str(path)!r} is not an n-gram table file (bad JSON/gzip: {e})") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != 1:
            raise InvalidRequestError(f"{str(path)!r} is not a version-1 {FORMAT} file; build one with "
                                      f"`specfleet ngram build`")
        model = cls(int(doc["order"]), min_count, max_entries)
        try:
            for key, entries in doc["tables"].items():
                n = int(key)
                for e in entries:
                    *ctx, tok, c = (int(x) for x in e)
                    if len(ctx) != n - 1 or c < 1:
                        raise ValueError(f"entry {e} does not fit order {n}")
                    model._count(n, tuple(ctx), tok, c)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise InvalidRequestError(f"n-gram table file {str(path)!r} is corrupt: {e}") from e
        return model


class NgramProposer:
    """The n-gram model drafting for the target directly (deterministic, so verified as point masses)."""

    def __init__(self, config: NgramConfig | None = None, model: NgramModel | None = None, name: str = "ngram"):
        self.config = config or NgramConfig()
        self.config.validate()
        if model is None:
            model = NgramModel.load(self.config.path, self.config.min_count, self.config.max_entries) \
                if self.config.path else NgramModel(self.config.order, self.config.min_count, self.config.max_entries)
        self.model = model
        self.name = name

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def set_num_speculative_tokens(self, n: int) -> None:
        from dataclasses import replace
        self.config = replace(self.config, num_speculative_tokens=n)

    def propose(self, requests: list) -> dict[str, DraftTree]:
        cfg = self.config
        trees = {}
        for req in requests:
            tokens = req.all_token_ids
            if cfg.learn_online:
                self.model.learn(req.request_id, tokens)
            tree = self.model.propose_tree(tokens, cfg.num_speculative_tokens, cfg.top_children, cfg.max_nodes,
                                           cfg.min_prob, self.name)
            if len(tree):
                trees[req.request_id] = tree
        return trees

    def observe(self, feedback: list) -> None:
        pass  # committed tokens are learned at the next propose, drafted or not

    def release(self, request_id: str) -> None:
        pass  # the model remembers what it counted of the request (see NgramModel._learned)
