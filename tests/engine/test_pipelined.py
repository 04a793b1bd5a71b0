"""Pipelined execution: greedy output unchanged, no leaked blocks, back-pressure holds, m search rule."""
import random
import threading
import time

import pytest

from specfleet.engine.engine import Engine
from specfleet.engine.pipelined import PipelinedEngine
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.engine.result_pool import (MicroBatchSearch, PipelineConfig, PipelineFailed, PoolEntry, ResultPool,
                                     search_micro_batches)
from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specfleet.core.tree import DraftTree
from tiny_engines import LENGTHS, SMALL, churn, engine_config, make_drafter, prompts_for
from tiny_models import random_prompts, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(target):
    return {b: [o.token_ids for o in run_to_completion(Engine(target, None, engine_config(target)), prompts_for(b),
                                                         GREEDY)] for b in LENGTHS}


def assert_drafter_caches_empty(drafters):
    for p in drafters:
        if hasattr(p, "blocks"):
            p.blocks.check_invariant()
            assert p.blocks.num_free_blocks == p.blocks.num_blocks


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("kind", ["draft-chain", "draft-tree", "lookup-chain"])
def test_pipelined_greedy_equals_plain_greedy(target, draft, plain_outputs, kind, batch):
    drafter = make_drafter(kind, draft)
    with PipelinedEngine(target, None, engine_config(target), drafter,
                         pipeline=PipelineConfig(num_micro_batches=2)) as eng:
        out = run_to_completion(eng, prompts_for(batch), GREEDY)
    assert [o.token_ids for o in out] == plain_outputs[batch]
    # some drafts right; at batch > 1 (prompts the drafts do not repeat) some wrong too,
    # so an accept-all or reject-all verifier fails here
    assert 0 < eng.stats.num_accepted <= eng.stats.num_drafted
    assert batch == 1 or eng.stats.num_accepted < eng.stats.num_drafted
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert_drafter_caches_empty([drafter])


@pytest.mark.parametrize("m", [1, 3, None])
def test_any_number_of_micro_batches_and_two_drafters_keep_greedy_output(target, draft, plain_outputs, m):
    drafters = [make_drafter("draft-chain", draft), make_drafter("draft-chain", draft)]
    pc = PipelineConfig(num_micro_batches=m, search_window=2)
    with PipelinedEngine(target, None, engine_config(target), drafters=drafters, pipeline=pc) as eng:
        out = run_to_completion(eng, prompts_for(8), GREEDY)
    assert [o.token_ids for o in out] == plain_outputs[8]
    stats = eng.pipeline_stats()
    assert all(t > 0 for t in stats["draft_busy_s"]), "both drafters must have drafted"
    assert stats["pool_occupancy_max"] <= stats["pool_capacity"]
    assert stats["throughput_tok_s"] > 0 and stats["steps"] > 0 and stats["target_idle_s"] >= 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert_drafter_caches_empty(drafters)


def test_each_drafter_hears_the_engines_clock(target, draft, plain_outputs):
    """As in the serial engine (tests/strategies/test_fleet.py), every drafter's composition gets the engine's measured
    step before each drafting after its first (core/proposer.observe_step): its own drafting seconds, the
    target's verify seconds since, the batch it drafts for; it never times gaps itself."""
    from specfleet.core.proposer import StepTiming

    seen: dict[int, list[StepTiming]] = {0: [], 1: []}

    class Listening(PromptLookupProposer):
        def __init__(self, i):
            super().__init__(PromptLookupConfig(4))
            self.i = i

        def observe_step(self, timing):
            seen[self.i].append(timing)

    drafters = [Listening(0), Listening(1)]
    with PipelinedEngine(target, None, engine_config(target), drafters=drafters,
                         pipeline=PipelineConfig(num_micro_batches=2)) as eng:
        out = run_to_completion(eng, prompts_for(8), GREEDY)
    assert [o.token_ids for o in out] == plain_outputs[8]
    assert all(len(v) >= 2 for v in seen.values()), {i: len(v) for i, v in seen.items()}
    every = seen[0] + seen[1]
    assert all(t.seconds > 0 and t.draft_seconds > 0 and t.verify_seconds >= 0 and t.batch >= 1 for t in every)
    assert max(t.verify_seconds for t in seen[0]) > 0  # the target verified between two of its draftings
    assert sum(t.verify_seconds for t in seen[0]) <= eng.stats.verify_time + 1e-9


def test_no_leak_under_preemption_aborts_and_sampling(target, draft):
    """Tight memory, many requests, random aborts of parked and running requests: all blocks freed."""
    rng = random.Random(0)
    drafters = [DraftModelProposer(draft, "draft", DraftModelConfig(3, top_children=c, max_nodes=5,
                                                                    kv_cache_bytes=40 << 10)) for c in (1, 2)]
    # 32 blocks of 4 tokens: six running requests of up to 70 tokens cannot all fit, so preemption happens
    # whatever the drafter threads' timing (48 blocks preempted 1-10 times per run, occasionally never)
    eng = PipelinedEngine(target, None, engine_config(target, 32, max_num_batched_tokens=24, max_num_seqs=6),
                          drafters=drafters, pipeline=PipelineConfig(num_micro_batches=2))
    prompts = [rng.sample(range(97), 1) * 3 + p for p in random_prompts([rng.randint(3, 27) for _ in range(24)])]
    reqs, _ = churn(eng, prompts, rng, abort_p=0.08, check=eng.blocks.check_invariant, max_steps=5000)
    eng.close()
    assert sum(r.num_preemptions for r in reqs) > 0, "the test must exercise preemption"
    assert any(r.finish_reason == "abort" for r in reqs)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert_drafter_caches_empty(drafters)


class FastProposer:
    """Drafts instantly (and badly): the drafters outrun the target."""

    name = "fast"

    def __init__(self):
        self.num_drafted = 0

    def propose(self, requests):
        self.num_drafted += len(requests)
        return {r.request_id: DraftTree.chain([r.all_token_ids[-1]] * 2, self.name) for r in requests}

    def observe(self, feedback):
        pass

    def release(self, request_id):
        pass


def test_back_pressure_bounds_the_pool_under_a_fast_drafter_and_a_slow_target(target, plain_outputs):
    fast = FastProposer()
    eng = PipelinedEngine(target, None, engine_config(target), drafters=[fast, FastProposer()],
                          pipeline=PipelineConfig(pool_capacity=3))
    execute = eng.runner.execute

    def slow_execute(*args, **kw):
        time.sleep(0.004)  # a slow verifier
        return execute(*args, **kw)

    eng.runner.execute = slow_execute
    with eng:
        out = run_to_completion(eng, prompts_for(8), GREEDY)
    assert [o.token_ids for o in out] == plain_outputs[8]
    stats = eng.pipeline_stats()
    assert stats["pool_occupancy_max"] == 3, "the pool fills up to its bound and never beyond"
    assert stats["back_pressure_waits"] > 0, "drafters had work but paused for room"
    assert fast.num_drafted > 0


def test_pool_keeps_its_bound_and_delivers_messages_in_order():
    pool = ResultPool(num_drafters=1, capacity=2)
    seen = []

    class Req:
        def __init__(self, i):
            self.request_id = f"r{i}"

    def drafter():
        while (claim := pool.claim(0)) is not None:
            seen.extend(("msg", m[1]) for m in claim.messages)
            seen.extend(("draft", r.request_id) for r in claim.requests)
            pool.put(0, [PoolEntry(r, None, 0, 0, 0.0) for r in claim.requests], 0.0)

    thread = threading.Thread(target=drafter)
    thread.start()
    for i in range(8):
        pool.submit(0, Req(i))
    pool.notify(0, "release", "r7")
    taken = []
    while len(taken) < 8:
        time.sleep(0.002)  # a slow consumer
        taken += [e.request.request_id for e in pool.take(2, wait_s=1.0)]
    pool.close()
    thread.join(timeout=5)
    assert taken == [f"r{i}" for i in range(8)]
    assert pool.max_occupancy == 2
    assert seen.index(("draft", "r7")) < seen.index(("msg", "r7")), "a release never overtakes its draft"


def test_a_dead_drafter_thread_fails_the_step(target):
    """A proposer's exception only costs its requests their drafts (tests/engine/test_draft_failures.py); a drafter
    thread that dies all the same (a BaseException) fails the step instead of leaving it waiting."""
    class Fatal(BaseException):
        pass

    class Broken(FastProposer):
        def propose(self, requests):
            raise Fatal("boom")

    with PipelinedEngine(target, None, engine_config(target), Broken()) as eng:
        with pytest.raises(PipelineFailed, match="boom"):
            run_to_completion(eng, prompts_for(3), GREEDY)


def round_time(m, n=8, draft=lambda b: 1 + b, verify=lambda b: 1 + b):
    """Synthetic steady state: one drafter and the target work on different micro-batches of n/m."""
    b = n / m
    return draft(n) + verify(n) if m == 1 else m * max(draft(b), verify(b))


@pytest.mark.parametrize("draft_cost, verify_cost, expected", [
    (lambda b: 1 + b, lambda b: 1 + b, 2),  # balanced: overlap pays, more splits only add overhead
    (lambda b: 0.05 * b, lambda b: 4 + b, 1),  # a nearly free draft: nothing to hide
    (lambda b: 2 + 0.3 * b * b, lambda b: 2 + 0.3 * b * b, 3),  # superlinear cost: smaller batches pay, to a point
])
def test_micro_batch_search_picks_the_expected_m(draft_cost, verify_cost, expected):
    def throughput(m):
        return 8 / round_time(m, 8, draft_cost, verify_cost)

    assert search_micro_batches(throughput, max_m=6) == expected
    online = MicroBatchSearch(max_m=6, window=4, min_gain=0.03)
    for _ in range(100):  # per target step: tokens emitted and seconds taken under the current m
        online.record(8 / online.m, round_time(online.m, 8, draft_cost, verify_cost) / online.m)
    assert online.is_settled and online.m == expected


def test_search_is_skipped_when_m_is_fixed():
    s = MicroBatchSearch(max_m=4, window=2, min_gain=0.0, fixed=3)
    for _ in range(20):
        s.record(1, 1.0)
    assert s.m == 3 and s.is_settled and not s.history


def test_bad_pipeline_settings_are_rejected(target, draft):
    from specfleet.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="num_micro_batches"):
        PipelineConfig(num_micro_batches=0).validate()
    with pytest.raises(InvalidRequestError, match="needs a draft"):
        PipelinedEngine(target, None, engine_config(target))


def test_remote_worker_body_drafts_from_token_deltas_like_a_local_draft(draft):
    """The Ray actor's body, run in-process: it mirrors requests from deltas and drafts what a local
    proposer drafts for the same tokens (this part needs no Ray)."""
    from specfleet.engine.request import Request
    from specfleet.drafting.remote import DraftWorker, RemoteDraftSpec, RequestDelta

    cfg = DraftModelConfig(3, kv_cache_bytes=SMALL)
    worker = DraftWorker(RemoteDraftSpec.from_model(draft, "w", cfg, num_threads=None))
    local = DraftModelProposer(draft, "w", cfg)
    req = Request("a", [5, 6, 7, 8, 9], GREEDY)
    assert worker.propose([RequestDelta("a", 0, [5, 6, 7, 8, 9], GREEDY)])["a"].token_ids == \
        local.propose([req])["a"].token_ids
    req.output_token_ids += [11, 12]
    assert worker.propose([RequestDelta("a", 5, [11, 12], None)])["a"].token_ids == \
        local.propose([req])["a"].token_ids
    with pytest.raises(RuntimeError, match="delta starts at 3"):
        worker.propose([RequestDelta("a", 3, [1], None)])
    worker.release("a")
    free, total = worker.cache_usage()
    assert free == total


def test_a_failed_step_fails_only_its_requests_in_the_pipelined_engine(target, plain_outputs):
    """The forward raises once: the requests of that step (a micro-batch) end with StepFailedError and their
    blocks are freed; the request out with its drafter meanwhile, and requests added afterwards, are served
    with their usual output."""
    from specfleet.engine.engine import StepFailedError

    eng = PipelinedEngine(target, None, engine_config(target), drafters=[make_drafter("lookup", None)],
                          pipeline=PipelineConfig(num_micro_batches=2))
    real, calls = eng.runner.execute, []

    def execute(items, blocks=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated kernel fault")
        return real(items, blocks)

    eng.runner.execute = execute
    prompts = prompts_for(3)
    with eng:
        first = [eng.add_request(p, GREEDY) for p in prompts]
        with pytest.raises(StepFailedError) as info:
            for _ in range(100):
                eng.step()
        failed = set(info.value.request_ids)
        assert failed and failed < {r.request_id for r in first}
        assert all(r.finish_reason == "abort" for r in first if r.request_id in failed)
        while eng.has_unfinished():
            eng.step()
        for i, r in enumerate(first):
            if r.request_id not in failed:
                assert r.output_token_ids == plain_outputs[3][i]
        assert eng.blocks.num_held_blocks == 0
        outs = run_to_completion(eng, prompts, GREEDY)
        assert [o.token_ids for o in outs] == plain_outputs[3]
