"""Prompt lookup's incremental index proposes exactly what scanning the whole context proposed, and a
step's cost does not grow with the context."""
from __future__ import annotations

import random
import time

import pytest

from specfleet.core.proposer import RequestSnapshot
from specfleet.drafting.prompt_lookup import LookupIndex, PromptLookupConfig, PromptLookupProposer


def scan_continuations(tokens: list[int], cfg: PromptLookupConfig) -> list[list[int]]:
    """The scan prompt lookup used before the index (the reference): every step, back over everything."""
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


def sequence(kind: str, rng: random.Random, length: int) -> list[int]:
    if kind == "random":
        return [rng.randrange(50) for _ in range(length)]
    if kind == "small-vocab":  # every n-gram recurs, with many different continuations
        return [rng.randrange(4) for _ in range(length)]
    out = []  # repetitive: motifs copied with mutations, as code and quoted text are
    motifs = [[rng.randrange(30) for _ in range(rng.randint(2, 9))] for _ in range(4)]
    while len(out) < length:
        m = list(rng.choice(motifs))
        if rng.random() < 0.3:
            m[rng.randrange(len(m))] = rng.randrange(30)
        out.extend(m)
    return out[:length]


CONFIGS = [PromptLookupConfig(4), PromptLookupConfig(3, max_ngram=3, min_ngram=1, num_branches=3),
           PromptLookupConfig(5, max_ngram=4, min_ngram=2, num_branches=2), PromptLookupConfig(2, 1, 1, 4)]


@pytest.mark.parametrize("kind", ["random", "small-vocab", "repetitive"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"k{c.num_speculative_tokens}-n{c.min_ngram}{c.max_ngram}"
                                                          f"-b{c.num_branches}")
def test_index_proposes_what_the_scan_proposed(kind, cfg):
    rng = random.Random(hash((kind, cfg.num_branches, cfg.min_ngram)) % 1000)
    for _ in range(5):
        tokens = sequence(kind, rng, 300)
        index, k = LookupIndex(cfg), 0
        while k < len(tokens):
            k += rng.randint(1, 5)  # a step commits one or more tokens
            index.extend(tokens[:k])
            assert index.continuations(tokens[:k], cfg.num_speculative_tokens) == scan_continuations(tokens[:k], cfg)


def test_proposer_follows_growing_requests_and_forgets_released_ones():
    cfg = PromptLookupConfig(3, num_branches=2)
    lookup, rng = PromptLookupProposer(cfg), random.Random(5)
    tokens = sequence("repetitive", rng, 200)
    for k in range(1, 200, 7):
        trees = lookup.propose([RequestSnapshot("r", tokens[:k]), RequestSnapshot("s", tokens[::-1][:k])])
        for rid, toks in (("r", tokens[:k]), ("s", tokens[::-1][:k])):
            want = scan_continuations(toks, cfg)
            assert (rid in trees) == bool(want)
    lookup.release("r")
    assert "r" not in lookup._index
    # the id reused for other tokens: a fresh index, not the released one's answers
    other = sequence("random", rng, 50)
    tree = lookup.propose([RequestSnapshot("s", other)]).get("s")
    assert (tree is not None) == bool(scan_continuations(other, cfg))


def test_a_step_costs_the_same_at_32k_tokens():
    """The scan took ~12 ms at 32k tokens here; looking the suffix up takes microseconds."""
    rng = random.Random(3)
    tokens = sequence("random", rng, 32_000)
    lookup = PromptLookupProposer(PromptLookupConfig(4))
    lookup.propose([RequestSnapshot("r", tokens[:-100])])  # indexing the prompt: once
    t0 = time.perf_counter()
    for k in range(len(tokens) - 100, len(tokens)):
        lookup.propose([RequestSnapshot("r", tokens[:k])])
    per_step = (time.perf_counter() - t0) / 100
    assert per_step < 2e-3, f"{per_step * 1e3:.2f} ms per step"
