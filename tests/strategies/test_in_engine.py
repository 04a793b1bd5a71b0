"""Every strategy on tiny models: speculative greedy output equals plain greedy output token for
token (batch 1, 3 and 8), and every KV block of every cache (target and each draft) is free after."""
import pytest

from specfleet.sampling_params import SamplingParams
from specfleet.strategies.factory import SpecConfig, build
from specfleet.core.proposer import leaves
from tiny_engines import LENGTHS, churn, make_engine, repetitive_prompts
from tiny_models import ours_from_hf, perturbed_copy, run_to_completion, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

STRATEGIES = {
    "vote": "vote(d1,d2,prompt-lookup)",
    "adaptive": "d1+adaptive[decision_threshold=2,initial_length=2,max_length=4]",
    "spin": "select[exploration_steps=4,chunk_steps=2,capacities=2:8:8](d1,d2,prompt-lookup)",
    "epsilon": "select[policy=epsilon-greedy,epsilon=0.5](d1,prompt-lookup)",
    "prompt-length": "select[policy=prompt-length](d1,d2)",
    "ngram": "ngram[min_prob=0.05,top_children=2]",
    "staged": "d1+ngram",
    "composed": "select[capacity=2,prepare_in_thread=true,exploration_steps=2,chunk_steps=1]"
                "(vote(d1,d2,prompt-lookup),d1,d2+ngram)+adaptive[decision_threshold=3]",
}


@pytest.fixture(scope="module")
def models():
    target = ours_from_hf(tiny_hf_model("qwen2"))
    return target, {"d1": perturbed_copy(target, 0.15), "d2": perturbed_copy(target, 0.3, seed=1)}


@pytest.fixture(scope="module")
def plain(models):
    target, _ = models
    return {b: [o.token_ids for o in run_to_completion(make_engine(target), repetitive_prompts(n), GREEDY)]
            for b, n in LENGTHS.items()}


def build_strategy(text, drafts, **spec):
    return build(text, SpecConfig(draft_kv_cache_bytes=64 << 10, **spec), drafts.__getitem__, 97)


def assert_all_free(eng, proposer):
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    for leaf in leaves(proposer):
        blocks = getattr(leaf, "blocks", None) or getattr(getattr(leaf, "draft", None), "blocks", None)
        if blocks is not None:
            blocks.check_invariant()
            assert blocks.num_free_blocks == blocks.num_blocks, f"{leaf.name} leaked draft KV blocks"


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_strategy_greedy_equals_plain_and_frees_everything(models, plain, kind, batch):
    target, drafts = models
    proposer = build_strategy(STRATEGIES[kind], drafts)
    eng = make_engine(target, proposer)
    out = run_to_completion(eng, repetitive_prompts(LENGTHS[batch]), GREEDY)
    assert [o.token_ids for o in out] == plain[batch]
    # some drafts right; at batch > 1 (prompts the drafts do not repeat) some wrong too,
    # so an accept-all or reject-all verifier fails here
    assert 0 < eng.stats.num_accepted <= eng.stats.num_drafted
    assert batch == 1 or eng.stats.num_accepted < eng.stats.num_drafted
    assert_all_free(eng, proposer)


def test_no_leak_under_preemption_aborts_and_sampling(models):
    """Tight target memory (preemption), random aborts, greedy and sampled requests mixed."""
    import random

    target, drafts = models
    rng = random.Random(0)
    proposer = build_strategy("select[exploration_steps=2,chunk_steps=1](vote(d1,d2,prompt-lookup),d2+ngram,ngram)"
                              "+adaptive[decision_threshold=3]", drafts)
    eng = make_engine(target, proposer, num_blocks=36, max_num_batched_tokens=24, max_num_seqs=6)
    reqs, _ = churn(eng, repetitive_prompts([rng.randint(3, 30) for _ in range(20)]), rng)
    assert sum(r.num_preemptions for r in reqs) > 0 and any(r.finish_reason == "abort" for r in reqs)
    assert_all_free(eng, proposer)
