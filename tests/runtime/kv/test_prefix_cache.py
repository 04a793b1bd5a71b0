"""Automatic prefix caching (runtime/kv/blocks.py): full blocks of computed tokens outlive their request
and are mapped into later requests that start with the same tokens. Checked: the block bookkeeping under
random operations against a model of the cache's contents (a mapped block always holds the tokens it is
mapped for, and no write ever reaches a registered block), and end to end on the native tiny model that
a second turn prefills only what is new and gives the same tokens as with the cache off, with speculation,
a draft model's own cache, chunked prefill and preemption."""
import random

import pytest
import torch

from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.engine.engine import Engine
from specfleet.runtime.backends.native import kernels as native_backend
from specfleet.runtime.formats import qtensor
from specfleet.runtime.kv.blocks import BlockManager
from specfleet.runtime.kv.cache import bytes_per_token
from specfleet.sampling_params import SamplingParams
from specfleet.strategies.factory import SpecConfig, build_proposer
from tiny_engines import steady_fleets
from tiny_models import random_prompts, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


# -- the block manager ---------------------------------------------------------------------------
def test_a_finished_requests_full_blocks_are_found_shared_and_evicted_last_used_first():
    bm = BlockManager(6, 4, enable_caching=True)
    toks = list(range(100, 111))  # 11 tokens: 2 full blocks, one partial
    bm.allocate("a", 11)
    bm.register("a", toks, 11, ha := [])
    assert bm.num_cached_blocks == 2 and len(ha) == 2  # the partial third block is never registered
    first_two = bm.block_ids("a")[:2]
    bm.free("a")
    assert bm.num_free_blocks == 6 and bm.num_held_blocks == 0  # cached blocks count as available
    # a prompt that shares 8 tokens maps both blocks; one that stops at exactly 8 maps only the first,
    # since its last token must be computed for its logits
    assert bm.cached_prefix(toks[:8] + [7, 7], []) == first_two
    assert bm.cached_prefix(toks[:8], []) == first_two[:1]
    assert bm.cached_prefix([1] + toks[1:], []) == []  # the hash chains: a different first block breaks it
    bm.allocate("b", 2, first_two)
    bm.allocate("c", 1, first_two[:1])
    assert bm.block_ids("b")[:2] == first_two and bm.num_tokens("b") == 10 and bm.num_held_blocks == 4
    # cutting into a block another table shares keeps only what precedes it
    assert bm.truncate("c", 2) == 0 and bm.num_tokens("c") == 0
    bm.check_invariant()
    bm.free("b")
    bm.free("c")
    # the pool: the LRU end is b's tail (freed tail first), so the head block survives the longest
    bm.allocate("d", 4 * 5)  # 5 blocks: 4 free + 1 evicted
    assert bm.num_evictions == 1 and bm.cached_prefix(toks[:8] + [7], []) == first_two[:1]
    bm.check_invariant()


def test_truncating_into_a_registered_block_held_alone_unregisters_it():
    bm = BlockManager(4, 4, enable_caching=True)
    toks = list(range(9))
    bm.allocate("a", 9)
    bm.register("a", toks, 9, [])
    assert bm.num_cached_blocks == 2
    assert bm.truncate("a", 6) == 6  # its tail will be overwritten: it must stop being a cached prefix
    assert bm.num_cached_blocks == 1 and bm.cached_prefix(toks, []) == bm.block_ids("a")[:1]
    bm.check_invariant()


def test_random_operations_never_map_a_block_that_holds_other_tokens():
    """A model of the cache's contents: every write puts the request's token into its slot; a mapped block
    must hold exactly the tokens of the prefix it is mapped for, and a write must never reach a registered
    block. Prompts share prefixes often (a few stems, a tiny vocabulary)."""
    rng = random.Random(3)
    bs = 3
    bm = BlockManager(40, bs, enable_caching=True)
    content = [None] * (40 * bs)
    stems = [[rng.randrange(4) for _ in range(rng.randint(3, 14))] for _ in range(4)]
    live: dict[str, dict] = {}
    hits = 0
    for step in range(4000):
        op = rng.random()
        if op < 0.25 or not live:
            rid = f"r{step}"
            toks = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randint(1, 8))]
            cached = bm.cached_prefix(toks, hashes := [])
            n_new = rng.randint(1, len(toks) - len(cached) * bs)
            if not bm.can_allocate(n_new, cached):
                continue
            bm.allocate(rid, n_new, cached)
            for i, b in enumerate(cached):
                assert content[b * bs:(b + 1) * bs] == toks[i * bs:(i + 1) * bs], "mapped a block of other tokens"
            hits += len(cached)
            req = live[rid] = {"toks": toks, "hashes": hashes, "computed": len(cached) * bs}
            _compute(bm, content, rid, req, n_new)
        else:
            rid = rng.choice(list(live))
            req = live[rid]
            if op < 0.55 and req["computed"] < len(req["toks"]):  # the next chunk (or decode) of known tokens
                n = rng.randint(1, len(req["toks"]) - req["computed"])
                if bm.can_append(rid, n):
                    bm.append(rid, n)
                    _compute(bm, content, rid, req, n)
            elif op < 0.7:  # a draft: slots past the computed tokens, then rolled back to the computed ones
                n = rng.randint(1, 5)
                if bm.can_append(rid, n):
                    bm.append(rid, n)
                    _write(bm, content, rid, range(req["computed"], req["computed"] + n), None)
                    assert bm.truncate(rid, req["computed"]) == req["computed"]
            elif op < 0.8:  # the request grows a token (an emitted one): known but not computed yet
                req["toks"].append(rng.randrange(4))
            else:
                bm.free(rid)
                del live[rid]
        bm.check_invariant()
    for rid in list(live):
        bm.free(rid)
    assert bm.num_held_blocks == 0 and hits > 100
    bm.check_invariant()


def _write(bm, content, rid, positions, toks):
    for p in positions:
        slot = bm.slot(rid, p)
        assert slot // bm.block_size not in bm._hash_of, "a write reached a registered block"
        content[slot] = None if toks is None else toks[p]


def _compute(bm, content, rid, req, n):
    """The forward of `n` more of the request's tokens: their KV is written, then its full blocks registered."""
    c = req["computed"]
    n = min(n, len(req["toks"]) - c)
    if bm.num_tokens(rid) < c + n:
        bm.append(rid, c + n - bm.num_tokens(rid))
    _write(bm, content, rid, range(c, c + n), req["toks"])
    req["computed"] = c + n
    bm.truncate(rid, c + n)
    bm.register(rid, req["toks"], c + n, req["hashes"])


# -- the engine ----------------------------------------------------------------------------------
needs_native = pytest.mark.skipif(not native_backend.available(), reason=f"native kernels: {native_backend.unavailable_reason()}")


@pytest.fixture(scope="module")
def target():
    from tiny_quant_models import quantized_model

    return quantized_model(tiny_hf_model("qwen2"))


def _engine(model, proposer=None, caching=True, num_blocks=512, block_size=4, **sched):
    cache = CacheConfig(block_size, bytes_per_token(model.config, torch.float32) * block_size * num_blocks, caching)
    return Engine(model, None, EngineConfig(cache, SchedulerConfig(**sched)), proposer)


def _run(eng, prompts, params=GREEDY):
    reqs = [eng.add_request(p, params) for p in prompts]
    done = {}
    for _ in range(10000):
        if not eng.has_unfinished():
            break
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [done[r.request_id] for r in reqs]


def _conversation(eng, turns, params=GREEDY):
    """Each turn resends the whole conversation (prompt, earlier answers, a new message), as a chat client does."""
    history, outs = [], []
    for msg in turns:
        history = history + msg
        out = _run(eng, [history], params)[0]
        outs.append(out)
        history = history + out.token_ids
    return outs


@needs_native
@pytest.mark.parametrize("draft", [None, "fleet(suffix,prompt-lookup)", "model"])
def test_a_second_turn_prefills_only_what_is_new_and_gives_the_same_tokens(target, draft):
    turns = random_prompts([45, 9, 13], seed=5)

    def proposer():
        if draft == "model":
            from tiny_quant_models import quantized_model

            return DraftModelProposer(quantized_model(tiny_hf_model("qwen2")), "draft",
                                      DraftModelConfig(3, kv_cache_bytes=4 << 20))
        return steady_fleets(build_proposer(draft, SpecConfig(), target.config.vocab_size, torch.float32,
                                            torch.device("cpu")))  # drafts kept, however busy the host

    off = _conversation(_engine(target, proposer(), caching=False), turns)
    eng = _engine(target, proposer())
    on = _conversation(eng, turns)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.metrics["num_cached_tokens"] for o in off] == [0, 0, 0]
    # turn 2 resends 45 + 16 tokens: the 15 full blocks of 4 below its last computed token are cached
    assert on[0].metrics["num_cached_tokens"] == 0
    assert on[1].metrics["num_cached_tokens"] == 60 and on[2].metrics["num_cached_tokens"] == 84
    assert eng.blocks.num_hit_tokens == 144 and eng.blocks.num_held_blocks == 0
    if draft is not None:
        assert sum(o.metrics["drafted"] for o in on) > 0 and sum(o.metrics["accepted"] for o in on) > 0
    if draft == "model":
        assert eng.proposer.blocks.num_hit_tokens > 0  # the draft's own cache reused the conversation too
        assert eng.proposer.blocks.num_held_blocks == 0
    eng.blocks.check_invariant()


@needs_native
def test_shared_prompts_under_preemption_and_small_chunks_give_the_uncached_output(target):
    """Six requests over two system prompts in a cache too small for them all, 16-token steps: blocks are
    shared while running, evicted, preempted requests find their own blocks again, and the tokens are
    those of an uncached roomy engine."""
    stems = random_prompts([30, 22], seed=8)
    tails = random_prompts([3, 7, 5, 9, 2, 6], seed=9)
    prompts = [stems[i % 2] + t for i, t in enumerate(tails)]
    draft = "fleet(suffix,prompt-lookup)"
    spec = build_proposer(draft, SpecConfig(), target.config.vocab_size, torch.float32, torch.device("cpu"))
    roomy = _run(_engine(target, spec, caching=False), prompts)
    spec = build_proposer(draft, SpecConfig(), target.config.vocab_size, torch.float32, torch.device("cpu"))
    tight = _engine(target, spec, num_blocks=30, max_num_batched_tokens=16)
    _run(tight, [stems[0] + [1], stems[1] + [2]])  # warm the cache with both system prompts
    outs = _run(tight, prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert tight.blocks.num_hit_tokens > 0 and tight.blocks.num_evictions > 0
    assert tight.blocks.num_held_blocks == 0
    tight.blocks.check_invariant()


@needs_native
def test_a_request_for_prompt_logprobs_computes_its_whole_prompt(target):
    prompt = random_prompts([30], seed=4)[0]
    eng = _engine(target)
    _run(eng, [prompt])
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    out = _run(eng, [prompt + [3]], params)[0]
    ref = _run(_engine(target, caching=False), [prompt + [3]], params)[0]
    assert out.metrics["num_cached_tokens"] == 0 and len(out.prompt_logprobs) == 31
    assert [lp.logprob for lp in out.prompt_logprobs[1:]] == [lp.logprob for lp in ref.prompt_logprobs[1:]]


def test_the_server_reports_cached_prompt_tokens_in_usage_and_metrics():
    from fastapi.testclient import TestClient

    from specfleet.llm import LLM
    from specfleet.server.app import ServerConfig, create_app
    from tiny_models import ours_from_hf

    prompt = random_prompts([40], seed=6)[0]
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for caching, want in ((True, 36), (False, 0)):
        llm = LLM.from_model(ours_from_hf(tiny_hf_model("llama")), None, None, dtype="float32", kv_cache_bytes=1 << 20,
                             block_size=4, enable_prefix_caching=caching)
        with TestClient(create_app(llm, ServerConfig("tiny"))) as client:
            first = client.post("/v1/completions", json={"prompt": prompt, **body}).json()
            second = client.post("/v1/completions", json={"prompt": prompt[:38], **body}).json()
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == want
            metrics = client.get("/metrics").text
            assert f"specfleet_prefix_cache_hit_tokens_total {float(want)}" in metrics
            assert "specfleet_prefix_cache_queried_tokens_total 78.0" in metrics


@needs_native
def test_samples_of_one_prompt_compute_it_once(target):
    """Three samples of one 41-token prompt arrive together: the first prefills it and the others wait for
    that prefill and map its 10 full blocks; the tokens are those of three separate uncached runs."""
    prompt = random_prompts([41], seed=12)[0]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=8, ignore_eos=True) for s in range(3)]
    ref = [_run(_engine(target, caching=False), [prompt], p)[0].token_ids for p in params]
    eng = _engine(target, max_num_batched_tokens=16)
    reqs = [eng.add_request(prompt, p) for p in params]
    while eng.has_unfinished():
        eng.step()
    assert [r.output_token_ids for r in reqs] == ref
    assert [r.num_cached_tokens for r in reqs] == [0, 40, 40] and eng.blocks.num_hit_tokens == 80
