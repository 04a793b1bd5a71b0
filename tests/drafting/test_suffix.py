"""Suffix drafting: the suffix trie against brute force, the proposer's trees, the draft spec, and
losslessness in the engine (greedy equality; the sampled distribution by the chi-square harness)."""
import random
from collections import Counter

import pytest

import specfleet.engine.executor as engine_module
from specfleet.engine.request import Request
from specfleet.errors import InvalidRequestError
from specfleet.sampling_params import SamplingParams
from specfleet.strategies.factory import SpecConfig, build
from specfleet.strategies.length import LengthController
from specfleet.strategies.selector import SelectorProposer
from specfleet.drafting.suffix import SuffixConfig, SuffixProposer
from specfleet.drafting.suffix_tree import Node, SuffixTrie
from specfleet.strategies.vote import VoteProposer
from tests.engine.test_distribution import (ALPHA, PARAMS, accept_every_draft, exact_joint, generate, one_thread,  # noqa: F401
                               p_values, setup)
from tiny_engines import count_shapes, make_engine, repetitive_prompts
from tiny_models import ours_from_hf, perturbed_copy, run_to_completion, tiny_hf_model

A, B, C, D, X = 1, 2, 3, 4, 9
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


# -- the trie ------------------------------------------------------------------------------------
def brute_counts(seqs, depth):
    c = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                c[tuple(s[i:i + n])] += 1
    return c


def trie_counts(trie):
    """Occurrences of every stored string, read off the trie (leaves expanded along their sequence)."""
    out, stack, num_nodes = Counter(), [(trie.root, ())], 0
    while stack:
        node, prefix = stack.pop()
        for t, child in node.children.items():
            num_nodes += 1
            path = prefix + (t,)
            if type(child) is Node:
                out[path] = child.count
                stack.append((child, path))
                continue
            out[path] += 1
            for tok in child.tokens[child.pos + 1:child.pos + 1 + trie.max_depth - len(path)]:
                path += (tok,)
                out[path] += 1
    return out, num_nodes


def test_worked_example():
    trie = SuffixTrie(3)
    trie.add("r", [A, B, A, B])
    node, length = trie.longest_repeat(8)
    assert length == 2 and node.count == 2  # "a b" occurred before
    assert [(t, f) for t, f, _ in trie.continuations((node, -1), length)] == [(A, 1.0)]
    assert trie_counts(trie)[0] == brute_counts([[A, B, A, B]], 3)


def test_counts_match_brute_force_through_adds_extends_and_removals():
    rng = random.Random(0)
    for _ in range(200):
        depth, vocab = rng.randint(2, 7), rng.randint(1, 4)
        trie, live = SuffixTrie(depth), {}
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.6 or not live:
                key, seq = rng.randint(0, 4), [rng.randrange(vocab) for _ in range(rng.randint(0, 15))]
                trie.add(key, seq[:len(seq) // 2])  # then grown in a second piece, as a request grows
                trie.extend(key, seq[len(seq) // 2:])
                live.pop(key, None)
                live[key] = seq
            else:
                key = rng.choice(list(live))
                trie.remove(key)
                del live[key]
            counts, num_nodes = trie_counts(trie)
            assert +counts == +brute_counts(live.values(), depth)
            assert num_nodes == trie.num_nodes and trie.num_tokens == sum(map(len, live.values()))
        for key in list(live):
            trie.remove(key)
        assert trie.num_nodes == 0 and not trie.root.children


def test_matches_and_continuations_match_brute_force():
    rng = random.Random(1)
    for _ in range(300):
        depth, vocab, max_len = rng.randint(2, 8), rng.randint(1, 3), rng.randint(1, 8)
        seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        own = SuffixTrie(depth)
        own.add("r", [])
        for t in seq:  # one token per step, as committed
            own.extend("r", [t])
        node, length = own.longest_repeat(max_len)
        found = [n for n in range(1, min(max_len, depth - 1, len(seq)) + 1)
                 if any(seq[i:i + n] == seq[-n:] for i in range(len(seq) - n))]
        assert length == max(found, default=0)
        if length:
            followers = Counter(seq[i + length] for i in range(len(seq) - length) if seq[i:i + length] == seq[-length:])
            total = sum(followers.values())
            got = {t: f for t, f, _ in own.continuations((node, -1), length)}
            assert got == pytest.approx({t: n / total for t, n in followers.items()})
        other = SuffixTrie(depth)
        other.add("g", seq)
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        _, length = other.longest_match(context, 1, max_len)
        found = [n for n in range(1, min(max_len, depth - 1, len(context)) + 1)
                 if any(seq[i:i + n] == context[-n:] for i in range(len(seq) - n + 1))]
        assert length == max(found, default=0)


def test_eviction_keeps_the_newest_within_the_cap():
    trie = SuffixTrie(8)
    rng = random.Random(2)
    for i in range(20):
        trie.add(i, [rng.randrange(50) for _ in range(30)])
        trie.evict_to(200, keep=i)
        assert trie.num_nodes <= 200 and i in trie.sequences
    assert 0 not in trie.sequences and len(trie.sequences) < 20
    assert trie_counts(trie)[0] == brute_counts(trie.sequences.values(), 8)
    with pytest.raises(ValueError, match="only the newest"):
        trie.extend(min(trie.sequences), [1])


# -- the proposer --------------------------------------------------------------------------------
def req(rid, tokens, **params):
    return Request(rid, list(tokens), SamplingParams(**params))


def test_tree_follows_the_longest_repeated_suffix_and_its_counts():
    p = SuffixProposer(SuffixConfig(min_match=1, min_prob=0.0))
    # "a b" (the longest repeat) was followed by c twice and by d once: c first; the budget is the
    # match length, 2
    tree = p.propose([req("r", [A, B, C, A, B, D, A, B, C, X, A, B])])["r"]
    assert tree.token_ids == [C, D] and tree.parents == [-1, -1] and tree.origins == ["suffix"] * 2
    # a longer match earns a deeper draft: the last 8 tokens repeat, so 8 nodes; the 8-token match's
    # continuation ends after 4 (the period), the 4-token match's goes on
    tree = p.propose([req("s", [A, B, C, X, A, B, C, X, A, B, C, X])])["s"]
    assert tree.is_chain and tree.token_ids == [A, B, C, X] * 2


def test_short_matches_and_unlikely_branches_give_no_nodes():
    p = SuffixProposer(SuffixConfig(min_match=3))
    assert p.propose([req("r", [A, B, C, D, X, C, D])]) == {}  # "c d" repeats, but 2 < min_match
    p = SuffixProposer(SuffixConfig(min_match=1, min_prob=0.3, factor=4.0))
    # after "a": b 3 times, c once, d once -> c and d (0.2 each) are below min_prob
    tree = p.propose([req("r", [A, B, A, B, A, B, A, C, A, D, A])])["r"]
    assert set(tree.token_ids) <= {A, B} and tree.token_ids[0] == B


def test_draft_state_grows_with_the_committed_tokens_only():
    p = SuffixProposer(SuffixConfig(min_match=1))
    r = req("r", [A, B, C, D])
    assert p.propose([r]) == {}
    r.output_token_ids += [X, A, B]  # committed since the last draft
    assert p.propose([r])["r"].token_ids == [C, D]
    assert p._requests["r"].trie.sequences["r"] == [A, B, C, D, X, A, B]
    p.set_num_speculative_tokens(1)  # +adaptive shortens the drafts
    assert p.propose([r])["r"].token_ids == [C]


def test_outputs_of_released_requests_are_matched_by_others():
    p = SuffixProposer(SuffixConfig(min_match=2))
    first = req("a", [X, X])
    p.propose([first])
    first.output_token_ids += [A, B, C, D, A]
    p.propose([first])
    p.release("a")
    assert p.global_trie.sequences == {"a": [A, B, C, D, A]}  # the output, not the prompt
    tree = p.propose([req("b", [D, X, A, B])])["b"]
    assert tree.token_ids == [C, D]  # nothing repeats in "d x a b" itself; "a b" is in a's output
    own_only = SuffixProposer(SuffixConfig(min_match=2, use_global=False))
    own_only.propose([first])
    own_only.release("a")
    assert own_only.propose([req("b", [D, X, A, B])]) == {} and own_only.global_trie.num_nodes == 0


def test_a_preempted_request_replaces_its_stored_output():
    p = SuffixProposer(SuffixConfig(global_nodes=40))
    r = req("r", [X, X])
    r.output_token_ids += [A, B]
    p.propose([r])
    p.release("r")  # preempted: stored so far
    r.output_token_ids += [C, D]
    p.propose([r])
    p.release("r")  # finished: stored again, replacing
    assert p.global_trie.sequences == {"r": [A, B, C, D]}
    long = req("big", [X])
    long.output_token_ids += list(range(10, 60))  # 50 distinct tokens: over the cap of 40 nodes alone
    p.propose([long])
    p.release("big")
    assert "big" not in p.global_trie.sequences and p.global_trie.num_nodes <= 40


# -- the draft spec ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    target = ours_from_hf(tiny_hf_model("qwen2"))
    return target, perturbed_copy(target, 0.15)


def spec(text, models):
    return build(text, SpecConfig(draft_kv_cache_bytes=64 << 10), {"d": models[1]}.__getitem__, 97)


def test_spec_options_set_the_config(models):
    p = spec("suffix[k=8,nodes=12,min_match=3,global=false,factor=0.5]", models)
    assert isinstance(p, SuffixProposer) and p.name == "suffix[k=8,nodes=12,min_match=3,global=false,factor=0.5]"
    c = p.config
    assert (c.max_depth, c.max_nodes, c.min_match, c.use_global, c.factor) == (8, 12, 3, False, 0.5)
    assert spec("suffix", models).name == "suffix"
    with pytest.raises(InvalidRequestError, match="unknown option 'width' for suffix; valid options: max_depth"):
        spec("suffix[width=2]", models)
    with pytest.raises(InvalidRequestError, match="min_match <= max_match"):
        spec("suffix[min_match=40]", models)
    with pytest.raises(InvalidRequestError, match="must follow a model name"):
        spec("suffix+ngram", models)


# -- losslessness in the engine ------------------------------------------------------------------
COMPOSITIONS = {
    "alone": lambda m: SuffixProposer(SuffixConfig(min_match=2)),
    "vote": lambda m: spec("vote(d,suffix)", m),
    "select": lambda m: spec("select(d,suffix[global=false])", m),
    "adaptive": lambda m: spec("suffix[min_match=1]+adaptive", m),
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind", list(COMPOSITIONS))
def test_speculative_greedy_equals_plain_greedy(models, kind, batch):
    target, _ = models
    prompts = repetitive_prompts({1: [13], 3: [4, 19, 9]}[batch])
    plain = run_to_completion(make_engine(target), prompts, GREEDY)
    proposer = COMPOSITIONS[kind](models)
    eng = make_engine(target, proposer)
    # twice: the second round also drafts from the first round's outputs in the shared trie
    for _ in range(2):
        out = run_to_completion(eng, prompts, GREEDY)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    suffix_name = next(n for n in eng.stats.drafted_by if n.startswith("suffix"))
    assert eng.stats.accepted_by.get(suffix_name, 0) > 0, eng.stats.as_dict()  # drafts were kept
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert isinstance(proposer, {"alone": SuffixProposer, "vote": VoteProposer, "select": SelectorProposer,
                                 "adaptive": LengthController}[kind])


def test_preemption_and_aborts_keep_outputs_exact_and_free_every_block(models):
    target, _ = models
    rng = random.Random(3)
    prompts = repetitive_prompts([rng.randint(3, 30) for _ in range(16)])
    plain = run_to_completion(make_engine(target), prompts, GREEDY)
    proposer = SuffixProposer(SuffixConfig(min_match=1, global_nodes=300))
    eng = make_engine(target, proposer, num_blocks=40, max_num_batched_tokens=24, max_num_seqs=6)
    reqs = [eng.add_request(p, GREEDY) for p in prompts]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        live = [r for r in reqs if not r.is_finished and r.output_token_ids]
        if live and steps % 15 == 0:
            eng.abort(rng.choice(live).request_id)
    assert sum(r.num_preemptions for r in reqs) > 0, "the test must exercise preemption"
    assert any(r.finish_reason == "abort" for r in reqs) and eng.stats.num_accepted > 0
    for r, want in zip(reqs, plain):
        n = len(r.output_token_ids)
        assert r.output_token_ids == want.token_ids[:n] and (r.finish_reason == "abort" or n == len(want.token_ids))
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert not proposer._requests and proposer.global_trie.num_nodes <= 300  # released, and the cap holds


@pytest.mark.parametrize("setting", ["t1", "t1.3-p0.8"])
def test_sampled_output_follows_the_target(setup, setting):  # noqa: F811
    hf, target, _, prompt = setup
    joint = exact_joint(hf, prompt, SamplingParams(**PARAMS[setting]))
    n = 1500
    # factor 4: budgets of 4 nodes from one matched token, so both chains and branched trees occur
    proposer = SuffixProposer(SuffixConfig(min_match=1, factor=4.0))
    shapes = count_shapes(proposer)
    samples, stats = generate(target, proposer, prompt, PARAMS[setting], n, 12_000_000)
    assert stats.num_drafted > n // 4 and 0.0 < stats.acceptance_rate < 1.0, stats.as_dict()
    assert shapes["branched"] > 0 and shapes["chain"] > 0, shapes  # siblings were tried as point masses
    p12, p123 = p_values(samples, joint)
    assert p12 > ALPHA and p123 > ALPHA, (p12, p123)


def test_the_sampled_statistic_catches_a_lossy_verifier(setup, monkeypatch):  # noqa: F811
    hf, target, _, prompt = setup
    monkeypatch.setattr(engine_module, "verify_sampled", accept_every_draft)
    joint = exact_joint(hf, prompt, SamplingParams(**PARAMS["t1"]))
    samples, _ = generate(target, SuffixProposer(SuffixConfig(min_match=1)), prompt, PARAMS["t1"], 500, 13_000_000)
    assert min(p_values(samples, joint)) < ALPHA
