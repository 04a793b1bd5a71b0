"""The pipeline with draft workers in other processes (Ray actors): same output, every cache freed.

Skipped when Ray is not installed, unless SPECFLEET_REQUIRE_RAY=1 (then a missing Ray fails).
"""
import os
import random

import pytest

try:
    import ray
except ImportError:
    if os.environ.get("SPECFLEET_REQUIRE_RAY") == "1":
        raise
    pytest.skip("ray is not installed: pip install 'specfleet[pipeline]'", allow_module_level=True)

from specfleet.engine.engine import Engine
from specfleet.engine.pipelined import PipelinedEngine
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig
from specfleet.engine.result_pool import PipelineConfig
from specfleet.drafting.remote import RemoteDraftSpec, remote_drafters
from tiny_engines import churn, engine_config, prompts_for
from tiny_models import perturbed_copy, random_prompts, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def workers(target):
    """Two actors, each with its own copy of the draft (sent as a state dict) and its own KV cache."""
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    spec = RemoteDraftSpec.from_model(perturbed_copy(target, 0.15), "remote-draft",
                                      DraftModelConfig(3, kv_cache_bytes=64 << 10), target_vocab_size=97)
    drafters = remote_drafters(spec, num_workers=2)
    yield drafters
    for d in drafters:
        d.close()
    ray.shutdown()


def assert_worker_caches_empty(drafters):
    for d in drafters:
        free, total = d.cache_usage()
        assert free == total


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_remote_drafts_keep_greedy_output(target, workers, batch):
    prompts = prompts_for(batch)
    plain = run_to_completion(Engine(target, None, engine_config(target)), prompts, GREEDY)
    with PipelinedEngine(target, None, engine_config(target), drafters=workers,
                         pipeline=PipelineConfig(num_micro_batches=2)) as eng:
        out = run_to_completion(eng, prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    # some drafts right; at batch > 1 (prompts the drafts do not repeat) some wrong too,
    # so an accept-all or reject-all verifier fails here
    assert 0 < eng.stats.num_accepted <= eng.stats.num_drafted
    assert batch == 1 or eng.stats.num_accepted < eng.stats.num_drafted
    assert all(o.token_origins.count("remote-draft") for o in out if len(o.token_ids) > 8)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert_worker_caches_empty(workers)


def test_remote_no_leak_with_sampling_preemption_and_aborts(target, workers):
    rng = random.Random(1)
    eng = PipelinedEngine(target, None, engine_config(target, 32, max_num_batched_tokens=24, max_num_seqs=6),
                          drafters=workers, pipeline=PipelineConfig(num_micro_batches=2))
    reqs, _ = churn(eng, random_prompts([rng.randint(3, 25) for _ in range(12)]), rng, max_tokens=(20, 30))
    eng.close()
    assert sum(r.num_preemptions for r in reqs) > 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert_worker_caches_empty(workers)
