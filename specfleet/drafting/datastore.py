"""Retrieval drafting from a datastore of text someone else wrote (REST: He et al., 2023).

No weights. A datastore is a token corpus (for code: the Python sources already on the machine, the standard
library and installed packages) tokenized with the target's tokenizer, and a suffix array over it. Every step
the longest suffix of the request's context that occurs in the corpus is found, and what followed its
occurrences becomes a best-first tree: a node's score is the share of the occurrences below its parent that
continue with its token, times its parent's score. The request's own text (prompt lookup, suffix) cannot guess
what it has not yet seen; fresh code repeats idioms that the corpus has many times ("for i in range(len(",
"raise ValueError(f\\"", "return result\\n"), and that is what this draft brings.

Layout: the suffix array is built over the corpus read backwards, so the longest suffix of the context is the
longest prefix of the context read backwards, found in one pass that narrows the array's range token by token
(the range of suffixes that start with the first j tokens is contiguous and sorted by their token j). Each
occurrence in the final range points at the token that followed the match in the forward text; the tree grows
from those positions with numpy (a child's positions are its parent's whose next token is the child's). A range
larger than `max_occurrences` is sampled evenly.

Files (one folder): tokens.npy (int32 forward corpus, -1 between source files), sa.npy (int32 suffix array of
the reversed corpus, sorted by at most SORT_DEPTH tokens: matches and continuations beyond that are never
needed), meta.json (the tokenizer's fingerprint, where the text came from, counts). Both arrays are memory-mapped,
so a server's processes share one copy. 28M tokens (the standard library, numpy, scipy, pandas, sympy,
matplotlib, transformers) take 224 MB; the standard library alone 3M tokens, 25 MB.

Why hand-written: the suffix array is 40 lines of numpy prefix doubling (bounded depth), the lookup is the
project's own drafting logic; no maintained library builds suffix arrays over token ids with numpy (pydivsufsort
works on bytes and is a C extension without wheels for every platform here).

Drafts are deterministic, so verification treats every node as a point mass (as for prompt lookup): lossless for
greedy and sampled requests alike.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specfleet.core.proposer import Feedback
from specfleet.core.tree import DraftTree, best_first_tree
from specfleet.errors import InvalidRequestError

SORT_DEPTH = 64  # the suffix array orders suffixes by at most this many tokens
FORMAT = "specfleet-datastore"
VERSION = 1


@functools.lru_cache(maxsize=8)
def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary (token string -> id): a datastore built with one tokenizer is
    refused by a target with another."""
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode()
    return hashlib.sha1(blob).hexdigest()[:16]


def suffix_array(tokens: np.ndarray, depth: int = SORT_DEPTH) -> np.ndarray:
    """Start positions of the suffixes of `tokens` (ints >= -1) in sorted order, compared on their first `depth`
    tokens rounded up to a power of two (ties beyond that in position order). Prefix doubling: after the round with span k every suffix has
    the rank of its first 2k tokens among all, as the pair (rank of the first k, rank of the next k)."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, np.int32)
    if n >= 2 ** 31 - 1:
        raise InvalidRequestError(f"a datastore holds fewer than 2^31 tokens, got {n}")
    rank = tokens.astype(np.int64) + 2  # -1 (a file boundary) -> 1; 0 is "past the end"
    k = 1
    while k < depth:
        nxt = np.zeros(n, np.int64)
        nxt[:n - k] = rank[k:]
        key = rank * (int(rank.max()) + 1) + nxt
        order = np.argsort(key, kind="stable")
        srt = key[order]
        rank = np.empty(n, np.int64)
        rank[order] = np.concatenate(([1], 1 + np.cumsum(srt[1:] != srt[:-1])))
        k *= 2
        if int(rank.max()) == n:  # every suffix distinct already
            break
    sa = np.argsort(rank, kind="stable")
    return sa.astype(np.int32)


class Datastore:
    """A tokenized corpus and the suffix array of it read backwards (module doc)."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray, meta: dict | None = None):
        if tokens.ndim != 1 or sa.shape != tokens.shape:
            raise InvalidRequestError(f"datastore: tokens {tokens.shape} and suffix array {sa.shape} must be "
                                      f"one-dimensional and of one length")
        self.tokens = tokens
        self.rev = tokens[::-1]  # a view: the corpus read backwards, what `sa` sorts
        self.sa = sa
        self.meta = dict(meta or {})
        # where each first token's range starts in sa (the widest narrowing, done by table): token t's suffixes
        # are sa[first[t + 2]:first[t + 3]], as the sort ranks a token t + 2 (a file boundary 1)
        counts = np.bincount(np.asarray(tokens, dtype=np.int64) + 2) if len(tokens) else np.zeros(2, np.int64)
        self.first = np.concatenate(([0], np.cumsum(counts)))
        self.max_token = len(counts) - 3  # the largest token id held (-1 when none)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def build(cls, sequences, meta: dict | None = None) -> "Datastore":
        """From token id sequences (one per source file): joined with -1 between them."""
        parts = []
        for seq in sequences:
            arr = np.asarray(seq, dtype=np.int64)
            if len(arr) and int(arr.min()) < 0:
                raise InvalidRequestError("datastore: token ids must be >= 0")
            if len(arr):
                parts += [arr.astype(np.int32), np.array([-1], np.int32)]
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return cls(tokens, suffix_array(tokens[::-1].copy()), meta)

    def save(self, folder: str | os.PathLike) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = {name: folder / f".{name}.tmp.npy" for name in ("tokens", "sa")}
        np.save(tmp["tokens"], np.ascontiguousarray(self.tokens))
        np.save(tmp["sa"], np.ascontiguousarray(self.sa))
        meta = {"format": FORMAT, "version": VERSION, "num_tokens": len(self), **self.meta}
        (folder / ".meta.tmp.json").write_text(json.dumps(meta, indent=1))
        for name, path in tmp.items():  # the meta file last: a folder with meta.json is complete
            os.replace(path, folder / f"{name}.npy")
        os.replace(folder / ".meta.tmp.json", folder / "meta.json")
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "Datastore":
        folder = Path(folder)
        meta_path = folder / "meta.json"
        if not meta_path.is_file():
            raise InvalidRequestError(f"datastore {str(folder)!r}: no meta.json there (build one with "
                                      f"`specfleet datastore build`)")
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r}, expected "
                                 f"{FORMAT!r} version {VERSION}")
            tokens = np.load(folder / "tokens.npy", mmap_mode="r")
            sa = np.load(folder / "sa.npy", mmap_mode="r")
            if tokens.dtype != np.int32 or sa.dtype != np.int32 or len(tokens) != meta.get("num_tokens"):
                raise ValueError(f"arrays {tokens.dtype}[{len(tokens)}], {sa.dtype}[{len(sa)}] do not match "
                                 f"{meta.get('num_tokens')} int32 tokens")
        except (OSError, ValueError, json.JSONDecodeError) as e:
            raise InvalidRequestError(f"datastore {str(folder)!r} is unreadable or corrupt: {e}") from e
        return cls(tokens, sa, meta)

    # -- lookup -----------------------------------------------------------------------------------
    def _narrow(self, lo: int, hi: int, j: int, tok: int) -> tuple[int, int]:
        """The sub-range of sa[lo:hi] (suffixes sharing their first j tokens) whose token j is `tok`."""
        rev, sa, n = self.rev, self.sa, len(self.rev)

        def at(i: int) -> int:
            p = int(sa[i]) + j
            return int(rev[p]) if p < n else -2  # past the end sorts first

        if hi - lo <= 64:  # token j of every suffix in the range, gathered at once
            p = np.asarray(sa[lo:hi], dtype=np.int64) + j
            col = np.where(p < n, np.asarray(rev)[np.minimum(p, n - 1)], -2)
            return lo + int(np.searchsorted(col, tok, "left")), lo + int(np.searchsorted(col, tok, "right"))
        a, b = lo, hi
        while a < b:  # first with token >= tok
            m = (a + b) // 2
            if at(m) < tok:
                a = m + 1
            else:
                b = m
        first = a
        b = hi
        while a < b:  # first with token > tok
            m = (a + b) // 2
            if at(m) <= tok:
                a = m + 1
            else:
                b = m
        return first, a

    def longest_match(self, context: list[int], max_match: int, min_count: int = 1) -> tuple[int, int, int]:
        """(length, lo, hi): the longest suffix of `context` (at most max_match tokens) that occurs at least
        min_count times, and the range of sa holding its occurrences (in the reversed corpus)."""
        lo, hi, length = 0, len(self.sa), 0
        first = self.first
        for j in range(min(max_match, len(context))):
            tok = int(context[-1 - j])
            if j == 0:
                a, b = (int(first[tok + 2]), int(first[tok + 3])) if 0 <= tok < len(first) - 3 else (0, 0)
            else:
                a, b = self._narrow(lo, hi, j, tok)
            if b - a < min_count:
                break
            lo, hi, length = a, b, j + 1
        return length, lo, hi

    def continuation_positions(self, lo: int, hi: int, length: int, max_occurrences: int) -> np.ndarray:
        """Forward positions of the tokens that followed the occurrences sa[lo:hi] of a `length`-token match
        (sampled evenly down to max_occurrences)."""
        idx = np.arange(lo, hi) if hi - lo <= max_occurrences else \
            np.linspace(lo, hi - 1, max_occurrences).astype(np.int64)
        # reversed position p starts the match read backwards: forward, the match ends at n-1-p
        return len(self.tokens) - np.asarray(self.sa[idx], dtype=np.int64)


@dataclass
class DatastoreConfig:
    path: str | None = None  # the datastore's folder (default: the one `specfleet datastore build` made for the
    # target's tokenizer, default_folder)
    max_depth: int = 8  # deepest draft node
    max_nodes: int = 8  # node budget at a long match
    factor: float = 1.0  # budget = min(max_nodes, factor * match length)
    max_match: int = 24  # longest suffix of the context that is matched
    min_match: int = 3  # shorter matches give no draft
    min_prob: float = 0.2  # nodes whose path share is below this are not proposed
    max_occurrences: int = 2048  # occurrences a tree is grown from (an evenly spaced sample beyond)

    def validate(self) -> None:
        if self.max_depth < 1 or self.max_nodes < 1 or self.max_occurrences < 1:
            raise InvalidRequestError("datastore: max_depth, max_nodes and max_occurrences must be >= 1")
        if not 1 <= self.min_match <= self.max_match <= SORT_DEPTH:
            raise InvalidRequestError(f"datastore: need 1 <= min_match <= max_match <= {SORT_DEPTH}, got "
                                      f"{self.min_match}, {self.max_match}")
        if self.factor <= 0 or not 0.0 <= self.min_prob <= 1.0:
            raise InvalidRequestError(f"datastore: need factor > 0 and 0 <= min_prob <= 1, got {self.factor}, "
                                      f"{self.min_prob}")


def grow(store: Datastore, positions: np.ndarray, budget: int, max_depth: int, min_prob: float,
         origin: str) -> tuple[DraftTree, float]:
    """The best-first tree of what followed the matches (forward `positions` of their next tokens) and its summed
    score (core/tree.best_first_tree). A child's positions are its parent's whose token is the child's, one on;
    the ends of files (-1) count among the siblings (the corpus stopped there) but are never proposed."""
    fwd, n = store.tokens, len(store.tokens)

    def children(state: tuple, depth: int):
        pos, tok = state  # a node's positions are made when it is expanded: most offered nodes never are
        if tok is not None:
            pos = pos[np.asarray(fwd[pos]) == tok] + 1
        pos = pos[pos < n]
        if not len(pos):
            return
        vals, counts = np.unique(np.asarray(fwd[pos]), return_counts=True)
        for v, c in zip(vals.tolist(), counts.tolist()):
            if v >= 0:
                yield v, c / len(pos), (pos, v)

    return best_first_tree(children, (positions, None), budget, max_depth, min_prob, origin)


class DatastoreProposer:
    """Drafts from a Datastore (module doc); one shared by every request."""

    def __init__(self, store: Datastore, config: DatastoreConfig | None = None, name: str = "datastore"):
        self.config = config or DatastoreConfig()
        self.config.validate()
        self.store, self.name = store, name
        self.depth = self.config.max_depth

    @property
    def num_speculative_tokens(self) -> int:
        return self.depth

    def set_num_speculative_tokens(self, n: int) -> None:
        self.depth = max(1, min(n, self.config.max_depth))

    def draft(self, context: list[int]) -> DraftTree | None:
        cfg = self.config
        length, lo, hi = self.store.longest_match(context, cfg.max_match)
        if length < cfg.min_match:
            return None
        positions = self.store.continuation_positions(lo, hi, length, cfg.max_occurrences)
        budget = min(cfg.max_nodes, max(1, math.floor(cfg.factor * length)))
        tree, _ = grow(self.store, positions, budget, self.depth, cfg.min_prob, self.name)
        return tree if len(tree) else None

    def propose(self, requests: list) -> dict[str, DraftTree]:
        trees = {}
        for r in requests:
            tree = self.draft(r.all_token_ids)
            if tree is not None:
                trees[r.request_id] = tree
        return trees

    def observe(self, feedback: list[Feedback]) -> None:
        pass  # the corpus is fixed; the fleet around it learns how often it is right

    def release(self, request_id: str) -> None:
        pass  # no per-request state


# -- building from the Python sources on this machine ---------------------------------------------------------
def python_sources(stdlib: bool = True, dirs=()) -> list[Path]:
    """The .py files of the running interpreter's standard library (without its test suites and site-packages)
    and of `dirs`, sorted."""
    import sysconfig

    roots = ([Path(sysconfig.get_paths()["stdlib"])] if stdlib else []) + [Path(d) for d in dirs]
    files = []
    for root in roots:
        if not root.is_dir():
            raise InvalidRequestError(f"datastore: {str(root)!r} is not a folder of sources")
        for f in root.rglob("*.py"):
            rel = f.relative_to(root).parts
            if stdlib and root == roots[0] and (rel[0] == "site-packages" or any(p in ("test", "tests") for p in rel)):
                continue
            files.append(f)
    return sorted(files)


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens (a fast tokenizer encodes them in one batch)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def build_from_files(files: list[Path], tokenizer, meta: dict | None = None) -> Datastore:
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue  # an unreadable or non-UTF-8 source is left out
    meta = {"tokenizer": tokenizer_fingerprint(tokenizer), "num_files": len(texts), **(meta or {})}
    return Datastore.build(encode_texts(tokenizer, texts), meta)


def default_folder(tokenizer) -> Path:
    """Where the standard-library datastore for `tokenizer` lives: $SPECFLEET_CACHE/datastores/."""
    import sys

    from specfleet.registry import cache_root

    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return cache_root() / "datastores" / f"python{version}-stdlib-{tokenizer_fingerprint(tokenizer)}"


def stdlib_datastore(tokenizer, log=print) -> Datastore:
    """The standard-library datastore for `tokenizer`, built once (about half a minute on two cores: 3M tokens)
    and kept in default_folder. Built in a private folder and renamed into place, so two processes that build
    at once both end with a complete one."""
    import shutil
    import tempfile

    folder = default_folder(tokenizer)
    if (folder / "meta.json").is_file():
        return Datastore.load(folder)
    files = python_sources()
    if log is not None:
        log(f"datastore: tokenizing {len(files)} standard-library sources into {folder} (once)")
    store = build_from_files(files, tokenizer, {"sources": "python standard library"})
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".build-"))
    except OSError as e:  # a read-only cache: draft from memory, built again next time
        if log is not None:
            log(f"datastore: cannot write {folder.parent} ({e}); keeping the store in memory")
        return store
    try:
        store.save(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first
            if not (folder / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Datastore.load(folder)


def check_tokenizer(store: Datastore, tokenizer, where: str) -> None:
    """Refuse a datastore built with another tokenizer than the target's."""
    have = store.meta.get("tokenizer")
    if tokenizer is not None and have is not None and have != tokenizer_fingerprint(tokenizer):
        raise InvalidRequestError(f"datastore {where!r} was built with another tokenizer ({have}) than the "
                                  f"target's ({tokenizer_fingerprint(tokenizer)}); rebuild it with "
                                  f"`specfleet datastore build --model <target>`")
