"""Speculative greedy output equals plain greedy output, token for token, for every proposer and shape."""
import random

import pytest

from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from tiny_engines import LENGTHS, churn, make_engine, proposers, repetitive_prompts
from tiny_models import random_prompts, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("kind", ["draft-chain", "draft-tree", "draft-cut-head", "draft-chain-pmin", "lookup-chain",
                                  "lookup-tree"])
def test_speculative_greedy_equals_plain_greedy(target, draft, kind, batch):
    prompts = repetitive_prompts(LENGTHS[batch])
    plain = run_to_completion(make_engine(target), prompts, GREEDY)
    proposer = proposers(draft)[kind]()
    eng = make_engine(target, proposer)
    spec = run_to_completion(eng, prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = eng.stats  # every draft here agrees only partly: some but not all tokens accepted
    # some drafts right; at batch > 1 (prompts the drafts do not repeat) some wrong too,
    # so an accept-all or reject-all verifier fails here
    assert 0 < stats.num_accepted <= stats.num_drafted
    assert batch == 1 or stats.num_accepted < stats.num_drafted
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    if hasattr(proposer, "blocks"):
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_accepted_tokens_are_marked_with_their_origin(target):
    eng = make_engine(target, DraftModelProposer(target, "self", DraftModelConfig(4, kv_cache_bytes=64 << 10)))
    # 31 tokens = the prefill's token + 6 full steps of 5
    out = run_to_completion(eng, random_prompts([10]), SamplingParams(temperature=0, max_tokens=31, ignore_eos=True))[0]
    # the prefill emits one target token; after it, a draft identical to the target is always
    # accepted: 4 drafted + 1 target token per step
    assert out.token_origins[:6] == ["target"] + ["self"] * 4 + ["target"]
    assert out.metrics["mean_accepted_length"] == 5.0
    assert out.metrics["acceptance_rate"] == 1.0 and out.metrics["steps"] == 6


def test_no_leak_under_preemption_aborts_and_random_acceptance(target, draft):
    """Tight memory, many requests, random aborts: every block of every cache is free at the end."""
    rng = random.Random(0)
    proposer = DraftModelProposer(draft, "draft", DraftModelConfig(3, top_children=2, max_nodes=5,
                                                                   kv_cache_bytes=40 << 10))
    eng = make_engine(target, proposer, num_blocks=48, max_num_batched_tokens=24, max_num_seqs=6)

    def check():
        eng.blocks.check_invariant()
        proposer.blocks.check_invariant()

    reqs, steps = churn(eng, repetitive_prompts([rng.randint(3, 30) for _ in range(24)]), rng, check=check)
    assert steps > 10
    assert sum(r.num_preemptions for r in reqs) > 0, "the test must exercise preemption"
    assert any(r.finish_reason == "abort" for r in reqs)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_stop_token_inside_an_accepted_run_ends_at_that_token(target):
    """With a draft identical to the target every step accepts 4 tokens; a stop token or max_tokens
    landing in the middle of such a run must still end the request exactly there."""
    # find a prompt whose output has a token first appearing inside the second speculative run
    # (1 prefill token + 4 + 4), so the stop lands mid-run
    for seed in range(50):
        prompt = random_prompts([12], seed=seed)[0]
        full = run_to_completion(make_engine(target), [prompt], GREEDY)[0].token_ids
        firsts = [i for i in range(6, 9) if full.index(full[i]) == i]
        if firsts:
            break
    first = firsts[0]
    stop_tok = full[first]
    for params, want in [
        (SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[stop_tok]), full[:first + 1]),
        (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), full[:7]),
    ]:
        proposer = DraftModelProposer(target, "self", DraftModelConfig(4, kv_cache_bytes=64 << 10))
        eng = make_engine(target, proposer)
        out = run_to_completion(eng, [prompt], params)[0]
        assert out.token_ids == want
        assert 0 < eng.stats.num_accepted < eng.stats.num_drafted
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_drafting_twice_without_a_commit_gives_the_same_draft(target, draft):
    from specfleet.engine.request import Request

    proposer = DraftModelProposer(draft, "draft", DraftModelConfig(4, kv_cache_bytes=64 << 10))
    req = Request("r", random_prompts([9])[0], GREEDY)
    first = proposer.propose([req])["r"]
    second = proposer.propose([req])["r"]
    assert first.token_ids == second.token_ids and len(first) == 4
    proposer.release("r")
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_p_min_stops_a_chain_where_the_draft_doubts_its_token(target, draft):
    """With p_min a chain ends after the first token whose draft probability is below p_min: every kept
    token but the last has probability >= p_min, the last is below it unless the chain ran to k, and at
    p_min = 0 (off) every chain is k long. A batch whose requests stop at different steps drafts each
    one's own tokens (the same as drafting it alone)."""
    import torch

    from specfleet.engine.request import Request

    k = 6
    prompts = random_prompts([9, 14, 5, 21], seed=5)
    full = DraftModelProposer(draft, "draft", DraftModelConfig(k, kv_cache_bytes=64 << 10))
    reqs = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    chains = full.propose(reqs)
    assert all(len(chains[r.request_id]) == k for r in reqs)
    # the draft's own probability of each chain token: the forwards of a full chain, spied on (one
    # catch-up forward, then k - 1 single-token steps, every request in each)
    seen = []
    forward = full.forward

    def spy(items, _forward=forward):
        out = _forward(items)
        seen.append(torch.softmax(out.float(), -1).max(-1).values.tolist())
        return out

    for r in reqs:
        full.release(r.request_id)
    full.forward = spy
    chains = full.propose(reqs)
    assert len(seen) == k
    probs = {r.request_id: [seen[j][i] for j in range(k)] for i, r in enumerate(reqs)}
    for r in reqs:
        full.release(r.request_id)
    p_min = sorted(x for v in probs.values() for x in v)[len(reqs) * k // 2]  # the median: some stop, some not
    stopped = DraftModelProposer(draft, "draft", DraftModelConfig(k, kv_cache_bytes=64 << 10, p_min=p_min))
    got = stopped.propose(reqs)
    lengths = []
    for r in reqs:
        toks, ps = got[r.request_id].token_ids, probs[r.request_id]
        n = next((j + 1 for j, x in enumerate(ps[:k - 1]) if x < p_min), k)
        assert toks == chains[r.request_id].token_ids[:n]
        lengths.append(n)
    assert min(lengths) < k and len(set(lengths)) > 1  # the control: the rule did stop chains, unevenly
    for r in reqs:
        stopped.release(r.request_id)
    assert stopped.blocks.num_free_blocks == stopped.blocks.num_blocks


def test_chain_draft_keeps_its_accepted_kv(target, draft):
    """A chain draft keeps the KV of the draft tokens it fed: with the target as its own draft every
    token is accepted, so each catch-up after the first feeds exactly 2 tokens (the unfed last draft
    token and the target's token) instead of k + 1 (the first one is the prompt and the prefill's token). With an imperfect draft the cache is cut back to
    the common prefix (never more than 2 tokens to feed), and the output is still the target's."""
    prompt = random_prompts([11], seed=3)
    plain = run_to_completion(make_engine(target), prompt, GREEDY)
    for model, perfect in ((target, True), (draft, False)):
        proposer = DraftModelProposer(model, "draft", DraftModelConfig(4, kv_cache_bytes=64 << 10))
        fed = []
        execute = proposer.runner.execute

        def spy(items, blocks, _execute=execute):
            fed.extend(len(item.token_ids) for item in items)
            return _execute(items, blocks)

        proposer.runner.execute = spy
        out = run_to_completion(make_engine(target, proposer), prompt, GREEDY)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]
        catch_ups = fed[::4]  # each draft: one catch-up forward, then k - 1 single-token steps
        assert fed[0] == 12 and set(fed) - set(catch_ups) <= {1}
        if perfect:
            assert catch_ups[1:] and set(catch_ups[1:]) == {2}
        else:
            # a rejection at position j leaves j accepted tokens already in the cache: 1 token to feed
            # after a first-token rejection, 2 otherwise (before, it was the accepted count + 1)
            assert set(catch_ups[1:]) == {1, 2}
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks  # released at the end


def test_tree_draft_nodes_take_the_rotary_positions_of_chain_tokens(target, draft):
    """A draft token at depth d (the d-th after the committed ones) sits at rotary position
    num_tokens + d - 1 whether the draft is a chain or a tree: the tree's levels once ran one
    position ahead, which only cost acceptance, so no output test could see it."""
    prompt = random_prompts([11], seed=3)[0]
    small = 64 << 10
    seen = {}
    for kind, cfg in (("chain", DraftModelConfig(3, kv_cache_bytes=small)),
                      ("tree", DraftModelConfig(3, top_children=2, max_nodes=8, kv_cache_bytes=small))):
        proposer = DraftModelProposer(draft, "draft", cfg)
        inner, items = proposer.forward, []
        proposer.forward = lambda batch, inner=inner, items=items: items.extend(batch) or inner(batch)
        engine = make_engine(target, proposer)
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()  # prefill + the first token
        items.clear()
        engine.step()  # one speculative step: the draft catches up, then drafts 3 levels
        # positions of the draft tokens fed after the catch-up forward, level by level
        catch_up = items[0]  # the committed tokens the draft had not seen yet
        num_tokens = catch_up.context_len + len(catch_up.token_ids)
        # positions of the draft tokens fed after it, level by level, counted from the committed tokens
        seen[kind] = [sorted({p - num_tokens for p in (it.positions if it.positions is not None else
                              range(it.context_len, it.context_len + len(it.token_ids)))}) for it in items[1:]]
    assert seen["chain"] == [[0], [1]]  # depth 1 at num_tokens, depth 2 right after
    assert seen["tree"] == seen["chain"]
