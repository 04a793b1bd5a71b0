"""One request's failure stays its own: a proposer that raises now and then costs its requests their
drafts, never the engine, and verified output stays exactly plain greedy decoding."""
from __future__ import annotations

import logging

import pytest

from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specfleet.engine.engine import Engine
from specfleet.engine.pipelined import PipelinedEngine
from specfleet.engine.result_pool import PipelineConfig
from specfleet.sampling_params import SamplingParams
from tiny_engines import engine_config, prompts_for
from tiny_models import run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class Flaky(PromptLookupProposer):
    """Prompt lookup whose `fail` call ("propose", "observe" or "release") raises every `every`-th time."""

    def __init__(self, fail: str, every: int = 3):
        super().__init__(PromptLookupConfig(4))
        self.fail, self.every, self.calls = fail, every, 0

    def _maybe_raise(self, call: str) -> None:
        if call == self.fail:
            self.calls += 1
            if self.calls % self.every == 0:
                raise RuntimeError(f"flaky {call}")

    def propose(self, requests):
        self._maybe_raise("propose")
        return super().propose(requests)

    def observe(self, feedback):
        self._maybe_raise("observe")

    def release(self, request_id):
        self._maybe_raise("release")


@pytest.fixture(scope="module")
def plain(target):
    return [o.token_ids for o in run_to_completion(Engine(target, None, engine_config(target)), prompts_for(8), GREEDY)]


@pytest.mark.parametrize("fail", ["propose", "observe", "release"])
def test_flaky_proposer_costs_drafts_not_requests(target, plain, fail, caplog):
    eng = Engine(target, None, engine_config(target), Flaky(fail))
    with caplog.at_level(logging.ERROR, logger="specfleet.engine"):
        outs = run_to_completion(eng, prompts_for(8), GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.stats.num_draft_failures >= 1
    assert eng.stats.as_dict()["draft_failures"] == eng.stats.num_draft_failures
    assert len([r for r in caplog.records if "continue without speculation" in r.message]) == 1, "logged once"
    if fail != "release":
        assert eng.stats.num_accepted > 0, "the requests the failures spared still speculate"
    # the engine keeps serving, and new requests speculate again
    again = run_to_completion(eng, prompts_for(8)[:2], GREEDY)
    assert [o.token_ids for o in again] == plain[:2]


def test_failed_requests_stop_drafting(target, plain):
    """After its proposer failed on it, a request is not offered to the proposer again."""
    proposer = Flaky("propose", every=1)  # every call fails
    eng = Engine(target, None, engine_config(target), proposer)
    outs = run_to_completion(eng, prompts_for(8), GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert proposer.calls == eng.stats.num_draft_failures <= 2  # once for the batch (at most twice: prefill waves)


@pytest.mark.parametrize("fail", ["propose", "observe", "release"])
def test_pipelined_drafter_that_raises_now_and_then(target, plain, fail):
    with PipelinedEngine(target, None, engine_config(target), Flaky(fail),
                         pipeline=PipelineConfig(num_micro_batches=2)) as eng:
        outs = run_to_completion(eng, prompts_for(8), GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert eng.stats.num_draft_failures >= 1
