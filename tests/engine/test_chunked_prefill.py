"""Chunked prefill sharing steps with decoding, and attention over the paged cache (issue 18).

Pins: the fair split rule; attention (views or gathers, context split by log-sum-exp) equals a dense
masked reference; decoding requests emit a token every step while a long prompt prefills; a short
prompt arriving mid-prefill is answered first; outputs with and without chunking are identical in
fp32 (plain, draft model and prompt lookup, chains and trees, plain and pipelined engines); no KV
block leaks after aborts and preemptions in the middle of a prefill.
"""
import random

import pytest
import torch
import torch.nn.functional as F

import specfleet.runtime.model.attention as attention
from specfleet.runtime.kv.blocks import BlockManager
from specfleet.engine.engine import Engine
from specfleet.engine.pipelined import PipelinedEngine
from specfleet.engine.scheduler import fair_shares
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.engine.result_pool import PipelineConfig
from tiny_engines import engine_config, make_drafter, proposers, repetitive_prompts
from tiny_models import random_prompts, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
UNCHUNKED = dict(max_num_batched_tokens=1 << 14, max_num_prefills=64)
CHUNKED = dict(max_num_batched_tokens=7, max_num_prefills=2)


def test_fair_shares_give_short_prompts_all_they_need_and_split_the_rest():
    assert fair_shares([20, 4000, 3000], 500) == [20, 240, 240]
    assert fair_shares([3, 4], 100) == [3, 4]
    assert fair_shares([50, 50, 50], 10) == [3, 3, 4]
    assert fair_shares([9, 9], 1) == [0, 1]
    assert fair_shares([], 10) == []


# -- attention ----------------------------------------------------------------------------------
def reference_attention(q, k, v, new_mask, context_mask, scale):
    """Dense [n, L] masked attention with K/V repeated per query head: q [n, H, D], k/v [L, KVH, D]."""
    n, c = q.shape[0], k.shape[0] - q.shape[0]
    group = q.shape[1] // k.shape[1]
    visible = torch.ones(n, c + n, dtype=torch.bool)
    visible[:, c:] = new_mask if new_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
    if context_mask is not None:
        visible[:, :c] = context_mask
    kr, vr = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), kr, vr, attn_mask=visible, scale=scale).transpose(0, 1)


def tree_mask(n, seed):
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    m = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        j = parents[i]
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


@pytest.mark.parametrize("split", [True, False])
def test_paged_attention_equals_dense_reference(split, monkeypatch):
    """Causal chunks with and without context, tree masks, hidden context, one-token decodes; blocks
    consecutive (read as a view) and scattered (gathered)."""
    if not split:
        monkeypatch.setattr(attention, "_cpu_flash", None)  # the one-masked-call path CUDA takes
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 6, 2, 16, 4
    k_cache, v_cache = torch.randn(64 * bs, kv_heads, dim), torch.randn(64 * bs, kv_heads, dim)
    cases = [(0, 9, None, None), (13, 7, None, None), (21, 6, tree_mask(6, 1), None), (30, 1, None, None),
             (11, 5, tree_mask(5, 2), torch.rand(5, 11) < 0.6), (8, 1, None, torch.rand(1, 8) < 0.5)]
    for scattered in (False, True):
        seqs, qs, expected, start_block = [], [], [], 0
        for c, n, new_mask, context_mask in cases:
            nb = -(-(c + n) // bs)
            ids = list(range(start_block, start_block + nb))
            if scattered:
                ids = ids[::-1]
            start_block += nb
            slots = (torch.tensor(ids)[:, None] * bs + torch.arange(bs)).flatten()[:c + n]
            kv = slots if scattered else slice(ids[0] * bs, ids[0] * bs + c + n)
            seqs.append(attention.SeqAttention(n, c, kv, new_mask, context_mask))
            q = torch.randn(n, heads, dim)
            qs.append(q)
            expected.append(reference_attention(q, k_cache[slots], v_cache[slots], new_mask, context_mask, 0.25))
        batch = attention.AttentionBatch(torch.zeros(0, dtype=torch.long), seqs)
        got = attention.paged_attention(torch.cat(qs), k_cache, v_cache, batch, 0.25)
        torch.testing.assert_close(got, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_block_placement_keeps_a_growing_request_consecutive():
    bm = BlockManager(64, 4)
    bm.allocate("long", 10)
    bm.allocate("short", 4)  # placed halfway into the gap, leaving "long" room to grow
    for _ in range(20):
        bm.append("long", 4)
        bm.append("short", 1)
        bm.truncate("long", bm.num_tokens("long") - 1)  # a rolled-back draft slot
    for rid in ("long", "short"):
        ids = bm.block_ids(rid)
        assert ids == list(range(ids[0], ids[0] + len(ids))), (rid, ids)
    bm.check_invariant()


# -- scheduling ---------------------------------------------------------------------------------
def test_running_request_emits_every_step_while_a_long_prompt_prefills(target):
    eng = Engine(target, None, engine_config(target, max_num_batched_tokens=16))
    long = eng.add_request(random_prompts([300], seed=3)[0], GREEDY)
    eng.step()  # the long prompt is admitted first, so it is ahead in the running list
    stream = eng.add_request(random_prompts([5])[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    eng.step()
    assert len(stream.output_token_ids) == 1
    steps = 0
    while not long.output_token_ids:
        before = len(stream.output_token_ids)
        eng.step()
        steps += 1
        assert len(stream.output_token_ids) == before + 1, "the running request stalled during the prefill"
    assert steps >= 300 // 15 - 2  # 15 tokens a step are left for the prompt: it really went in chunks


def test_short_request_arriving_mid_prefill_is_answered_before_the_long_prompt(target):
    eng = Engine(target, None, engine_config(target, max_num_batched_tokens=16))
    long = eng.add_request(random_prompts([400], seed=4)[0], GREEDY)
    for _ in range(3):
        eng.step()
    assert 0 < long.num_computed_tokens < len(long.prompt_token_ids)
    short = eng.add_request(random_prompts([6], seed=5)[0], GREEDY)
    eng.step()
    assert len(short.output_token_ids) == 1, "the short prompt waited behind the long one"
    assert long.num_computed_tokens < len(long.prompt_token_ids) and not long.output_token_ids
    while not long.output_token_ids:
        eng.step()
    assert len(short.output_token_ids) > 10  # it kept decoding through the rest of the long prefill


# -- losslessness -------------------------------------------------------------------------------
PROMPT_LENGTHS = [37, 5, 61, 12, 48, 3]


def outputs(model, prompts, sched, proposer=None):
    return [o.token_ids for o in run_to_completion(Engine(model, None, engine_config(model, **sched), proposer),
                                                   prompts, GREEDY)]


def test_plain_greedy_is_identical_with_and_without_chunking(target):
    prompts = repetitive_prompts(PROMPT_LENGTHS)
    assert outputs(target, prompts, CHUNKED) == outputs(target, prompts, UNCHUNKED)


@pytest.mark.parametrize("kind", ["draft-chain", "draft-tree", "lookup-chain", "lookup-tree"])
def test_speculative_greedy_is_identical_with_and_without_chunking(target, draft, kind):
    prompts = repetitive_prompts(PROMPT_LENGTHS)
    expected = outputs(target, prompts, UNCHUNKED)
    assert outputs(target, prompts, CHUNKED, proposers(draft)[kind]()) == expected


@pytest.mark.parametrize("kind", ["draft-tree", "lookup"])
def test_pipelined_engine_is_identical_with_chunked_prefills(target, draft, kind):
    prompts = repetitive_prompts(PROMPT_LENGTHS)
    expected = outputs(target, prompts, UNCHUNKED)
    with PipelinedEngine(target, None, engine_config(target, **CHUNKED), drafters=[make_drafter(kind, draft)],
                         pipeline=PipelineConfig(num_micro_batches=2)) as eng:
        assert [o.token_ids for o in run_to_completion(eng, prompts, GREEDY)] == expected
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


# -- memory -------------------------------------------------------------------------------------
@pytest.mark.parametrize("pipelined", [False, True])
def test_no_leak_after_aborts_and_preemptions_mid_prefill(target, draft, pipelined):
    rng = random.Random(1)
    proposer = DraftModelProposer(draft, "draft", DraftModelConfig(3, top_children=2, max_nodes=5,
                                                                   kv_cache_bytes=40 << 10))
    config = engine_config(target, 40, max_num_batched_tokens=12, max_num_seqs=5, max_num_prefills=3)
    eng = (PipelinedEngine(target, None, config, drafters=[proposer], pipeline=PipelineConfig(num_micro_batches=2))
           if pipelined else Engine(target, None, config, proposer))
    prompts = random_prompts([rng.randint(20, 70) for _ in range(16)], seed=9)
    params = [SamplingParams(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=rng.randint(1, 30),
                             ignore_eos=True) for i in range(16)]
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    num_aborted_mid_prefill = num_preempted_mid_prefill = 0
    for steps in range(5000):
        if not eng.has_unfinished():
            break
        mid = {r.request_id: r.num_preemptions for r in reqs
               if not r.is_finished and 0 < r.num_computed_tokens < len(r.prompt_token_ids)}
        eng.step()
        num_preempted_mid_prefill += sum(r.num_preemptions > mid[r.request_id] for r in reqs if r.request_id in mid)
        partial = [r for r in reqs if not r.is_finished and 0 < r.num_computed_tokens < len(r.prompt_token_ids)]
        if partial and rng.random() < 0.15:
            eng.abort(rng.choice(partial).request_id)
            num_aborted_mid_prefill += 1
        eng.blocks.check_invariant()
    if pipelined:
        eng.close()
    assert not eng.has_unfinished()
    assert num_aborted_mid_prefill > 0 and num_preempted_mid_prefill > 0, "the test must exercise both"
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


# -- mixed steps kept short (the measured row cap) -------------------------------------------------
def test_step_cost_model_measures_a_decode_step_and_the_per_row_cost():
    from specfleet.engine.step_costs import StepCostModel

    costs = StepCostModel()
    assert costs.row_cap(2.0) is None  # nothing measured yet: no cap
    for _ in range(20):
        costs.record(1, 0.010)  # a decode step: 10 ms
        costs.record(257, 0.010 + 256 * 0.001)  # a prompt chunk: 1 ms per extra row
    assert costs.decode_s == pytest.approx(0.010) and costs.row_s == pytest.approx(0.001)
    assert costs.row_cap(2.0) == 11  # 10 ms + 10 rows x 1 ms = 2 decode steps
    assert costs.row_cap(4.0) == 31
    first_prefill = StepCostModel()  # a server whose first work is a long prompt: large steps come first
    first_prefill.record(512, 0.010 + 511 * 0.001)
    assert first_prefill.row_cap(2.0) is None
    first_prefill.record(1, 0.010)
    assert first_prefill.row_cap(2.0) == 11


def test_step_cost_model_calibrates_when_every_decode_step_is_large():
    """More than 8 requests decoding from the start (or drafts that make every step long): no step has
    few rows, yet the decode step and the per-row cost are still told apart (issue 31)."""
    from specfleet.engine.step_costs import StepCostModel

    costs = StepCostModel()
    costs.record(480, 0.010 + 480 * 0.001)  # 16 prompts prefilled together
    for _ in range(20):
        costs.record(16, 0.010 + 16 * 0.001)  # then 16 requests decode: 26 ms a step
    assert costs.row_s == pytest.approx(0.001) and costs.decode_s == pytest.approx(0.026)
    assert costs.row_cap(2.0) == 16 + 26  # 26 more rows cost one more decode step
    for _ in range(20):  # with 4-token drafts every step of 16 requests is 80 rows
        costs.record(80, 0.010 + 80 * 0.001)
    assert costs.row_cap(2.0) == 16 + 26, "the smallest steps stay the decode step"
    close = StepCostModel()  # steps too close in size to tell the per-row cost from noise: no cap
    close.record(40, 0.05)
    close.record(16, 0.03)
    assert close.row_cap(2.0) is None


def test_the_row_cap_is_calibrated_at_batch_twelve(target, monkeypatch):
    """Twelve requests prefilled together, then decoding twelve rows a step: the engine sets a row cap."""
    eng = Engine(target, None, engine_config(target, max_num_seqs=16, max_num_prefills=16,
                                             max_num_batched_tokens=512))
    real = eng.runner.execute

    def timed(items, blocks=None):  # a step's time is 2 ms + 0.05 ms a row (sleep dominates the tiny model)
        import time
        time.sleep(0.002 + 0.00005 * sum(len(it.token_ids) for it in items))
        return real(items, blocks)

    monkeypatch.setattr(eng.runner, "execute", timed)
    for p in random_prompts([24] * 12, seed=5):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert all(len(r.output_token_ids) >= 2 for r in eng.requests.values()), "all twelve decode"
    assert eng.scheduler.row_cap is not None and eng.scheduler.row_cap >= 12


def test_mixed_steps_stay_under_the_row_cap_and_a_lone_prompt_does_not(target, monkeypatch):
    eng = Engine(target, None, engine_config(target, max_num_batched_tokens=64))
    monkeypatch.setattr(eng.executor.costs, "row_cap", lambda factor: 12)
    rows = []
    real = eng.runner.execute

    def spy(items, blocks=None):
        rows.append(sum(len(it.token_ids) for it in items))
        return real(items, blocks)

    monkeypatch.setattr(eng.runner, "execute", spy)
    long = eng.add_request(random_prompts([300], seed=3)[0], GREEDY)
    eng.step()
    assert rows[-1] == 64  # alone: the whole budget
    stream = eng.add_request(random_prompts([5])[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    eng.step()  # the stream's prompt and a chunk of the long one share the step: 16 prompt tokens at most
    assert rows[-1] <= 16 and len(stream.output_token_ids) == 1
    steps = 0
    while not long.output_token_ids:
        before = len(stream.output_token_ids)
        eng.step()
        steps += 1
        assert rows[-1] <= 1 + 16  # the stream's row, then the prompt gets what the cap leaves (>= MIN_CHUNK)
        assert len(stream.output_token_ids) == before + 1
    assert steps >= (300 - 64 - 16) // 16  # without the cap, 63 tokens a step would have finished it in 4


def test_the_row_cap_does_not_change_outputs(target):
    prompts = random_prompts(PROMPT_LENGTHS, seed=11)
    capped = Engine(target, None, engine_config(target, max_num_batched_tokens=64))
    capped.executor.costs.row_cap = lambda factor: 5
    got = [o.token_ids for o in run_to_completion(capped, prompts, GREEDY)]
    assert got == outputs(target, prompts, UNCHUNKED)
