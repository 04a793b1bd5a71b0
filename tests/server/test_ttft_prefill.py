"""A short request's first token behind a long prefill (issue 44, item 15), by mechanism, not by timing.

A request that arrives during a long prefill waits for the step in flight, then for its own first step.
The server bounds every step's time (AsyncEngine sets Engine.max_step_s): the cost model turns the
time into rows (StepCostModel.rows_within), so a lone long prompt runs in short steps too, and a fresh
server, which has measured nothing yet, still starts with a bounded step. Step costs here are fixed
numbers given to the cost model (nothing is timed), so every bound below is exact.
"""
from __future__ import annotations

import pytest

from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.engine.async_engine import SERVING_STEP_S, AsyncEngine
from specfleet.engine.engine import Engine
from specfleet.engine.scheduler import MIN_CHUNK
from specfleet.engine.step_costs import FIRST_STEP_ROWS, StepCostModel
from specfleet.sampling_params import SamplingParams
from tiny_models import ours_from_hf, random_prompts, tiny_hf_model

SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return ours_from_hf(tiny_hf_model("llama", max_position_embeddings=4096))


def engine(model, budget: int = 512) -> Engine:
    c = model.config
    block_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 16
    return Engine(model, None, EngineConfig(CacheConfig(16, block_bytes * 512),
                                            SchedulerConfig(max_num_batched_tokens=budget)))


class FixedCosts(StepCostModel):
    """The step costs a + b * rows, given, not measured: record() keeps nothing."""

    def __init__(self, points: list[tuple[int, float]]):
        super().__init__()
        for rows, seconds in points:
            super().record(rows, seconds)

    def record(self, rows: int, seconds: float) -> None:
        pass


def spy_rows(eng: Engine) -> list[int]:
    rows: list[int] = []
    real = eng.runner.execute

    def spy(items, blocks=None):
        rows.append(sum(len(it.token_ids) for it in items))
        return real(items, blocks)

    eng.runner.execute = spy
    return rows


def test_rows_within_a_time_from_the_line_from_large_steps_alone_and_before_any():
    costs = StepCostModel()
    assert costs.rows_within(0.2) == FIRST_STEP_ROWS  # a fresh server: nothing measured
    costs.record(512, 0.010 + 511 * 0.002)  # only a lone prompt's full steps so far
    # all of their time taken as per row (2.0 ms rather than 1.98): errs short
    assert costs.rows_within(0.2) == int(0.2 * 512 / (0.010 + 511 * 0.002))
    costs.record(1, 0.010)  # a decode step: now the line is known, 10 ms + 2 ms a row
    assert costs.rows_within(0.2) == 1 + 95
    assert costs.fixed_s == pytest.approx(0.010)


def test_a_served_engine_bounds_its_steps():
    class Bare:
        pass

    bare = Bare()
    AsyncEngine(bare)
    assert bare.max_step_s == SERVING_STEP_S and 0 < SERVING_STEP_S <= 0.25


def test_a_lone_long_prompt_runs_in_bounded_steps_so_a_short_one_waits_little(model):
    """Costs 10 ms + 2 ms a row: a 512-row step takes ~1 s. With the 0.2 s bound a lone prompt's steps
    carry 96 rows, and a short request arriving during one gets its first token from the next step,
    which its prompt shares with a chunk of the long one under the mixed-step cap."""
    eng = engine(model)
    eng.max_step_s = 0.2
    eng.executor.costs = FixedCosts([(1, 0.010), (512, 0.010 + 511 * 0.002)])
    rows = spy_rows(eng)
    long = eng.add_request(random_prompts([2000], seed=1)[0], ONE)
    for _ in range(3):
        eng.step()
    assert rows == [96] * 3, "a lone prompt's step is cut to the time bound (512 rows without it)"
    short = eng.add_request(random_prompts([5], seed=2)[0], SHORT)
    eng.step()
    assert len(short.output_token_ids) == 1, "the short request's first token comes from its first step"
    assert rows[-1] <= max(MIN_CHUNK, eng.scheduler.row_cap), "which is a short, shared step"
    while not long.is_finished:
        eng.step()
    assert max(rows) <= 96


def test_a_fresh_server_starts_with_a_bounded_step_and_then_measures(model):
    eng = engine(model)
    eng.max_step_s = 0.2
    rows = spy_rows(eng)
    eng.add_request(random_prompts([1000], seed=3)[0], ONE)
    eng.step()
    assert rows == [FIRST_STEP_ROWS], "nothing measured yet: the first step is bounded all the same"


def test_the_bound_never_cuts_steps_below_twenty_fixed_parts(model):
    """A model whose decode step alone takes 50 ms: the 0.2 s bound would leave 4 fixed parts a step (a
    prefill 25 % slower); the step gets 20 fixed parts instead (1 s)."""
    eng = engine(model)
    eng.max_step_s = 0.2
    eng.executor.costs = FixedCosts([(1, 0.050), (512, 0.050 + 511 * 0.002)])
    rows = spy_rows(eng)
    eng.add_request(random_prompts([1000], seed=4)[0], ONE)
    eng.step()
    assert rows == [1 + round((20 * 0.050 - 0.050) / 0.002)]


def test_offline_use_keeps_the_whole_budget(model):
    eng = engine(model)
    eng.executor.costs = FixedCosts([(1, 0.010), (512, 0.010 + 511 * 0.002)])
    rows = spy_rows(eng)
    eng.add_request(random_prompts([1000], seed=5)[0], ONE)
    eng.step()
    assert rows == [512]
