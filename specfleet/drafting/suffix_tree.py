"""A bounded-depth suffix trie over token sequences with occurrence counts, built online.

Every substring of at most `max_depth` tokens of every stored sequence is a path from the root, and
a node's count is the number of places its string occurs. The counts of a node's children are
therefore the frequencies of what followed its string, which is what suffix drafting ranks by.

Open leaves (the suffix tree's trick): a path that only one occurrence follows is not spelled out
node by node. A Leaf points at the token of its sequence where that occurrence left the explicit
nodes and stands for the rest of the occurrence, up to `max_depth`; a leaf of a growing sequence
grows with it for free. Text without repeats therefore costs about one leaf per token. When a second
occurrence reaches a leaf's first token, that token becomes a node of count 2 with a leaf one token
further down (a split), one level per appended token.

Appending a token touches only the root and the sequence's *active* occurrences: the suffixes of
the sequence that occurred before (they sit on explicit nodes), at most `max_depth` of them and
usually a handful. The deepest active node is the longest suffix of the sequence that occurred
earlier, so the drafter's own-context match costs nothing extra.

Worked example, max_depth 3, sequence "a b a b" appended token by token:

    a  -> root.a = Leaf(0)                                   active: []
    b  -> root.b = Leaf(1)                                   active: []
    a  -> root.a splits: node "a" (2), "a".b = Leaf(1)       active: ["a"]
    b  -> "a".b splits: node "a b" (2), "a b".a = Leaf(2)    active: ["a b", "b"]
          root.b splits: node "b" (2), "b".a = Leaf(2)

Now "a b" (occurs twice) is the longest repeated suffix, and its child "a" (a leaf, count 1) is
what followed it: the draft after "... a b" starts with "a".

Invariant: only the newest sequence grows (`extend`); every other stored sequence is complete, so
a split that reaches the end of one of them ends that occurrence for good.
"""
from __future__ import annotations

from specfleet.errors import InvalidRequestError


class Node:
    __slots__ = ("children", "count")

    def __init__(self, count: int):
        self.children: dict[int, Node | Leaf] = {}
        self.count = count


class Leaf:
    """One occurrence's path from `tokens[pos]` on (the token at the leaf's own depth), count 1."""

    __slots__ = ("tokens", "pos")

    def __init__(self, tokens: list[int], pos: int):
        self.tokens = tokens
        self.pos = pos


# A place in the trie: (node, -1) at an explicit node, or (leaf, k) after leaf.tokens[k] inside a leaf
Cursor = tuple  # tuple[Node | Leaf, int]


class SuffixTrie:
    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise InvalidRequestError(f"a suffix trie needs max_depth >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node(0)
        self.num_nodes = 0  # explicit nodes and leaves, the root excluded
        self.num_tokens = 0
        self.sequences: dict[object, list[int]] = {}  # key -> tokens, oldest first
        self._open_key: object = None
        self._active: list[tuple[Node, int]] = []  # (node, depth) of the open sequence, deepest first

    # -- building ------------------------------------------------------------------------------
    def add(self, key: object, tokens: list[int]) -> None:
        """Store a new sequence under `key` (replacing one stored under it) and make it the open one."""
        if key in self.sequences:
            self.remove(key)
        self.sequences[key] = []
        self._open_key = key
        self._active = []
        self.extend(key, tokens)

    def extend(self, key: object, tokens: list[int]) -> None:
        """Append tokens to the open (newest) sequence."""
        if key != self._open_key or key not in self.sequences:
            raise ValueError(f"only the newest sequence can grow, not {key!r}")
        seq = self.sequences[key]
        for t in tokens:
            seq.append(t)
            self._append(seq, t)
        self.num_tokens += len(tokens)

    def _append(self, seq: list[int], t: int) -> None:
        n = len(seq) - 1  # index of t
        limit = self.max_depth
        active: list[tuple[Node, int]] = []
        for node, depth in self._active + [(self.root, 0)]:
            child = node.children.get(t)
            if child is None:  # nobody went this way before: the occurrence continues as a leaf
                node.children[t] = Leaf(seq, n)
                self.num_nodes += 1
                continue
            if type(child) is Node:
                child.count += 1
            else:  # another occurrence's leaf starts with t: make that token a node of both
                split = Node(2)
                nxt = child.pos + 1
                if depth + 1 < limit and nxt < len(child.tokens):
                    child.pos = nxt
                    split.children[child.tokens[nxt]] = child
                else:  # the leaf's occurrence ends here (depth bound or end of its complete sequence)
                    self.num_nodes -= 1
                node.children[t] = split
                self.num_nodes += 1
                child = split
            if depth + 1 < limit:
                active.append((child, depth + 1))
        self._active = active

    def remove(self, key: object) -> None:
        """Forget a stored sequence: every occurrence's counts, and the nodes nothing else uses."""
        seq = self.sequences.pop(key)
        if key == self._open_key:
            self._open_key, self._active = None, []
        self.num_tokens -= len(seq)
        for i in range(len(seq)):
            node = self.root
            for k in range(i, min(i + self.max_depth, len(seq))):
                child = node.children[seq[k]]
                if type(child) is Leaf:
                    assert child.tokens is seq and child.pos == k, "a leaf of another occurrence on this path"
                    del node.children[seq[k]]
                    self.num_nodes -= 1
                    break
                child.count -= 1
                if child.count == 0:  # only this occurrence used it; the rest of its path goes too
                    del node.children[seq[k]]
                    self.num_nodes -= 1
                node = child

    def evict_to(self, max_nodes: int, keep: object = None) -> None:
        """Remove the oldest sequences (never `keep`) until at most `max_nodes` nodes are left."""
        while self.num_nodes > max_nodes:
            oldest = next((k for k in self.sequences if k != keep), None)
            if oldest is None:
                return
            self.remove(oldest)

    # -- matching -------------------------------------------------------------------------------
    def longest_repeat(self, max_len: int) -> tuple[Node | None, int]:
        """(node, length) of the longest suffix of the open sequence, at most `max_len` tokens, that
        also occurred earlier; (None, 0) when its last token is new."""
        for node, depth in self._active:
            if depth <= max_len:
                return node, depth
        return None, 0

    def walk(self, tokens: list[int], start: int) -> Cursor | None:
        """The cursor at the end of the path spelling tokens[start:], or None if it is not stored."""
        obj, pos = self.root, -1
        for k in range(start, len(tokens)):
            t = tokens[k]
            if pos < 0:
                child = obj.children.get(t)
                if child is None:
                    return None
                obj, pos = (child, -1) if type(child) is Node else (child, child.pos)
            else:
                pos += 1
                if pos >= len(obj.tokens) or obj.tokens[pos] != t:
                    return None
        return obj, pos

    def longest_match(self, context: list[int], min_len: int, max_len: int) -> tuple[Cursor | None, int]:
        """(cursor, length) of the longest suffix of `context` of min_len..max_len tokens that is
        stored, or (None, 0). Binary search: every substring of a stored string is stored, so if a
        suffix of length L is found, so are all shorter ones."""
        lo, hi = min_len, min(max_len, len(context), self.max_depth - 1)
        best: tuple[Cursor | None, int] = (None, 0)
        while lo <= hi:
            mid = (lo + hi) // 2
            cur = self.walk(context, len(context) - mid)
            if cur is None:
                hi = mid - 1
            else:
                best, lo = (cur, mid), mid + 1
        return best

    def continuations(self, cursor: Cursor, depth: int) -> list[tuple[int, float, Cursor]]:
        """(token, frequency, cursor after it) for what followed the string at `cursor` (`depth`
        tokens long), in first-seen order; frequencies sum to 1 over the occurrences that continue."""
        obj, pos = cursor
        if depth >= self.max_depth:
            return []
        if pos >= 0:  # inside a leaf: its one occurrence goes on, if its sequence does
            nxt = pos + 1
            return [(obj.tokens[nxt], 1.0, (obj, nxt))] if nxt < len(obj.tokens) else []
        kids = obj.children
        if not kids:
            return []
        counts = [c.count if type(c) is Node else 1 for c in kids.values()]
        total = sum(counts)
        return [(t, n / total, (c, -1) if type(c) is Node else (c, c.pos))
                for (t, c), n in zip(kids.items(), counts)]
