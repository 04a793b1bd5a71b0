"""The specfleet_spec_length gauge reports the current adaptive length of real controllers, whether
the controller wraps the whole composition or sits inside a vote or a selector."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.core.proposer import speculation_length
from specfleet.engine.async_engine import AsyncEngine
from specfleet.engine.engine import Engine
from specfleet.sampling_params import SamplingParams
from specfleet.server.metrics import ServerMetrics
from specfleet.strategies.factory import SpecConfig, build
from specfleet.strategies.length import LengthController
from tiny_models import ours_from_hf, perturbed_copy, random_prompts, tiny_hf_model

ADAPTIVE = "adaptive[initial_length=6,decision_threshold=1000]"  # 6, not the configured 4, and it stays there


@pytest.fixture(scope="module")
def target():
    return ours_from_hf(tiny_hf_model("qwen2"))


@pytest.fixture(scope="module")
def drafts(target):
    return {"d1": perturbed_copy(target, 0.1), "d2": perturbed_copy(target, 0.2, seed=1)}


def scrape(target, proposer) -> str:
    async def main() -> str:
        engine = Engine(target, None, EngineConfig(CacheConfig(4, 1 << 20), SchedulerConfig()), proposer)
        ae = AsyncEngine(engine, max_queue=4)
        metrics = ServerMetrics(ae)
        ae.start()
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        [o async for o in ae.generate(random_prompts([6])[0], params, "m")]
        await ae.shutdown()
        return generate_latest(metrics.registry).decode()

    return asyncio.run(main())


@pytest.mark.parametrize("text, controller", [
    (f"vote(d1,d2)+{ADAPTIVE}", lambda p: p),
    (f"vote(d1+{ADAPTIVE},prompt-lookup[k=1])", lambda p: p.children[0]),
    (f"select(d1+{ADAPTIVE},prompt-lookup[k=1])", lambda p: p.children[0]),
])
def test_gauge_reports_the_adaptive_length(text, controller, target, drafts):
    proposer = build(text, SpecConfig(num_speculative_tokens=4, draft_kv_cache_bytes=64 << 10), drafts.__getitem__,
                     target.config.vocab_size)
    ctrl = controller(proposer)
    assert isinstance(ctrl, LengthController) and ctrl.length == 6
    assert speculation_length(proposer) == 6
    assert "specfleet_spec_length 6.0" in scrape(target, proposer)
    ctrl.set_num_speculative_tokens(3)  # the controller moves: the reading follows
    assert speculation_length(proposer) == 3


def test_plain_drafts_report_their_configured_length(drafts, target):
    for text, want in [("d1", 4), ("d1[k=5]", 5), ("prompt-lookup[k=2]", 2), ("suffix[k=7]", 7), ("ngram", 4)]:
        proposer = build(text, SpecConfig(num_speculative_tokens=4, draft_kv_cache_bytes=64 << 10),
                         drafts.__getitem__, target.config.vocab_size)
        assert speculation_length(proposer) == want, text
