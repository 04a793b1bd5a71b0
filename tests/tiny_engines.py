"""Engines on the tiny models, shared by the tests: the paged cache sized in fp32 blocks of 4 slots, the
prompt sets (every other prompt repeats a motif, so prompt lookup finds matches) and the draft proposers."""
from __future__ import annotations

from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specfleet.engine.engine import Engine
from specfleet.sampling_params import SamplingParams
from tiny_models import random_prompts

LENGTHS = {1: [13], 3: [4, 19, 9], 8: [5, 17, 9, 30, 3, 12, 8, 21]}
SMALL = 64 << 10  # a draft's KV cache


def engine_config(model, num_blocks=400, **sched) -> EngineConfig:
    c = model.config
    per_block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 4
    return EngineConfig(CacheConfig(4, per_block * num_blocks), SchedulerConfig(**sched))


def make_engine(model, proposer=None, num_blocks=400, **sched):
    return Engine(model, None, engine_config(model, num_blocks, **sched), proposer)


def repetitive_prompts(lengths):
    """Prompts that repeat themselves, so prompt lookup finds matches (and several branches)."""
    out = []
    for i, n in enumerate(random_prompts(lengths, seed=7)):
        motif = n[:4] or [1]
        out.append((motif * (len(n) // len(motif) + 1))[:len(n)] if i % 2 else n)
    return out


def prompts_for(batch):
    return repetitive_prompts(LENGTHS[batch])


def churn(eng, prompts, rng, abort_p=0.05, max_tokens=(1, 40), check=None, max_steps=None):
    """Adds `prompts` as greedy and sampled requests mixed (temperature 0 or 0.8, seed i, max_tokens drawn from
    the `max_tokens` range, EOS ignored) and steps `eng` until none is unfinished, aborting a random live
    request with probability `abort_p` after each step, then calling `check()` (an invariant), if given; with
    `max_steps` it fails past that many steps. Every draw comes from `rng`. Returns (requests, steps)."""
    params = [SamplingParams(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=rng.randint(*max_tokens),
                             ignore_eos=True) for i in range(len(prompts))]
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        live = [r for r in reqs if not r.is_finished]
        if live and rng.random() < abort_p:
            eng.abort(rng.choice(live).request_id)
        if check is not None:
            check()
        assert max_steps is None or steps < max_steps
    return reqs, steps


def proposers(draft):
    small = SMALL
    return {
        "draft-chain": lambda: DraftModelProposer(draft, "draft", DraftModelConfig(4, kv_cache_bytes=small)),
        "draft-tree": lambda: DraftModelProposer(draft, "draft", DraftModelConfig(3, top_children=3, max_nodes=8,
                                                                                  kv_cache_bytes=small)),
        "draft-cut-head": lambda: DraftModelProposer(draft, "draft", DraftModelConfig(4, kv_cache_bytes=small,
                                                                                      head_vocab=60)),
        "draft-chain-pmin": lambda: DraftModelProposer(draft, "draft", DraftModelConfig(4, kv_cache_bytes=small,
                                                                                        p_min=0.5)),
        "lookup-chain": lambda: PromptLookupProposer(PromptLookupConfig(4)),
        "lookup-tree": lambda: PromptLookupProposer(PromptLookupConfig(4, min_ngram=1, num_branches=3)),
    }


def make_drafter(kind, draft):
    if kind == "draft-chain":
        return DraftModelProposer(draft, "draft", DraftModelConfig(4, kv_cache_bytes=SMALL))
    if kind == "draft-tree":
        return DraftModelProposer(draft, "draft", DraftModelConfig(3, top_children=3, max_nodes=8, kv_cache_bytes=SMALL))
    return PromptLookupProposer(PromptLookupConfig(4))


class SteadyClock:
    """A clock that advances one second per reading."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def steady_fleets(proposer):
    """Put every fleet in a composed proposer on a SteadyClock and return the proposer. A fleet trims its trees
    and turns steps plain from step times; on the wall clock a busy host makes verified nodes look dear, so a test
    that needs drafts verified (rows checked, some kept) drew few or none on a loaded CI machine (132 steps, 2 drafted
    tokens). On the steady clock every step reads one second whatever its node count: a node costs nothing, no tree
    is trimmed, and the choices depend on the tokens alone. A drafting call reads as a second too, so a fleet with a
    draft model rarely calls it and one with the default margin may still decode plain where drafting looks dear:
    give it a near-zero margin where only weightless members should draft every step."""
    from specfleet.strategies.fleet import FleetProposer

    seen = set()

    def walk(p):
        if id(p) in seen:
            return
        seen.add(id(p))
        if isinstance(p, FleetProposer):
            p.clock = SteadyClock()  # a fleet with its own clock leaves the engine's seconds out (observe_step)
        for c in getattr(p, "children", None) or ():
            walk(c)

    walk(proposer)
    return proposer


def count_shapes(proposer):
    """Wrap proposer.propose to count the trees it sends, "chain" or "branched"; returns the Counter."""
    from collections import Counter

    shapes, propose = Counter(), proposer.propose

    def counting(requests):
        trees = propose(requests)
        shapes.update("branched" if not t.is_chain else "chain" for t in trees.values())
        return trees

    proposer.propose = counting
    return shapes
