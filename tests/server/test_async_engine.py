"""AsyncEngine in-process with a tiny random model (fast, no real model needed), and the pure pieces of
the server: stream deltas and schema error wording."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.engine.async_engine import AsyncEngine, EngineDeadError, EngineUnavailableError, QueueFullError
from specfleet.engine.engine import Engine
from specfleet.errors import InvalidRequestError
from specfleet.outputs import RequestOutput
from specfleet.sampling_params import SamplingParams
from specfleet.core.stats import SpecStats
from specfleet.server.metrics import ServerMetrics
from specfleet.server.schemas import ChatCompletionRequest, CompletionRequest, describe_validation_error
from specfleet.server.serving import DeltaText
from tiny_models import ours_from_hf, random_prompts, run_to_completion, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def engine_for(model, num_blocks: int = 64, block_size: int = 4, **sched) -> Engine:
    c = model.config
    block_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * block_size
    return Engine(model, None, EngineConfig(CacheConfig(block_size, block_bytes * num_blocks), SchedulerConfig(**sched)))


@pytest.fixture(scope="module")
def model():
    return ours_from_hf(tiny_hf_model("llama"))


async def collect(stream) -> list[RequestOutput]:
    return [out async for out in stream]


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def is_idle(ae: AsyncEngine) -> bool:
    s = ae.snapshot
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks


def test_concurrent_streams_equal_offline(model):
    prompts = random_prompts([5, 9, 14, 3, 20, 7])
    want = run_to_completion(engine_for(model), prompts, GREEDY)

    async def main() -> list[list[RequestOutput]]:
        ae = AsyncEngine(engine_for(model), max_queue=16)
        ae.start()
        streams = [ae.generate(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)]
        got = await asyncio.gather(*(collect(s) for s in streams))
        await until(lambda: is_idle(ae))
        await ae.shutdown()
        return got

    for outs, ref in zip(asyncio.run(main()), want):
        assert outs[-1].finished and outs[-1].token_ids == ref.token_ids
        assert not any(o.finished for o in outs[:-1])
        lengths = [len(o.token_ids) for o in outs]
        assert lengths == sorted(lengths)  # cumulative


def slowed(engine: Engine, seconds: float) -> Engine:
    """Each step takes at least `seconds`, so a test can tell an abort from a request that just finished."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step
    return engine


def test_cancelled_consumer_aborts_and_frees_blocks(model):
    async def main() -> None:
        ae = AsyncEngine(slowed(engine_for(model), 0.02), max_queue=4)
        ae.start()
        stream = ae.generate(random_prompts([6])[0], LONG, "long")

        async def read_until_stalled() -> None:
            async with contextlib.aclosing(stream):  # what the server does with every stream
                async for out in stream:
                    if len(out.token_ids) >= 2:
                        await asyncio.sleep(3600)  # a client that stalls; it gets cancelled

        task = asyncio.create_task(read_until_stalled())
        await until(lambda: ae.snapshot.num_running == 1 and ae.snapshot.stats.num_emitted >= 2)
        task.cancel()
        await until(lambda: is_idle(ae), timeout_s=0.5)  # a step is 20 ms; finishing would take 3 s
        assert ae.snapshot.stats.num_emitted < 40 and ae.num_queued == 0
        await ae.shutdown(timeout_s=1)

    asyncio.run(main())


def test_closing_an_unread_stream_aborts_it(model):
    async def main() -> None:
        ae = AsyncEngine(slowed(engine_for(model), 0.02), max_queue=4)
        ae.start()
        stream = ae.generate(random_prompts([6])[0], LONG, "never-read")
        await until(lambda: ae.snapshot.num_running == 1)
        await stream.aclose()  # a response cancelled before its first read does exactly this
        await until(lambda: is_idle(ae), timeout_s=0.5)
        assert not stream.is_finished
        assert [out async for out in stream] == []
        await ae.shutdown(timeout_s=1)

    asyncio.run(main())


def test_queue_bound_rejects_with_distinct_error(model):
    async def main() -> None:
        ae = AsyncEngine(engine_for(model, max_num_seqs=1), max_queue=2)
        ae.start()
        prompts = random_prompts([4, 4, 4])
        first = ae.generate(prompts[0], GREEDY, "a")
        second = ae.generate(prompts[1], GREEDY, "b")
        with pytest.raises(QueueFullError, match="max_queue=2"):
            ae.generate(prompts[2], GREEDY, "c")
        await asyncio.gather(collect(first), collect(second))
        assert ae.num_queued == 0
        await collect(ae.generate(prompts[2], GREEDY, "c"))  # room again
        await ae.shutdown()

    asyncio.run(main())


def test_bad_request_fails_alone(model):
    async def main() -> None:
        ae = AsyncEngine(engine_for(model), max_queue=4)
        ae.start()
        good = ae.generate(random_prompts([5])[0], GREEDY, "good")
        bad = ae.generate([1, 2, 10_000], GREEDY, "bad")  # outside the tiny vocabulary
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await collect(bad)
        assert (await collect(good))[-1].finished
        assert ae.is_healthy
        await ae.shutdown()

    asyncio.run(main())


def test_step_failure_is_loud_and_final(model, caplog):
    async def main() -> None:
        engine = engine_for(model)
        ae = AsyncEngine(engine, max_queue=4)

        def broken_step():
            raise RuntimeError("device on fire")

        engine.step = broken_step
        ae.start()
        with pytest.raises(EngineDeadError, match="device on fire"):
            await collect(ae.generate(random_prompts([5])[0], GREEDY, "x"))
        await until(lambda: not ae.is_healthy)
        with pytest.raises(EngineDeadError):
            ae.generate(random_prompts([5])[0], GREEDY, "y")
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        await ae.shutdown()

    asyncio.run(main())
    assert "engine step failed" in caplog.text


def test_shutdown_cancels_what_does_not_finish_in_time(model):
    import time

    engine = engine_for(model)
    step = engine.step

    def slow_step():  # a step slow enough that the request cannot reach the model's length in the grace time,
        time.sleep(0.02)  # on a CPU of any speed (the tiny model's context is a few hundred tokens)
        return step()

    engine.step = slow_step

    async def main() -> None:
        ae = AsyncEngine(engine, max_queue=4)
        ae.start()
        stream = ae.generate(random_prompts([5])[0], SamplingParams(temperature=0, max_tokens=10**6,
                                                                   ignore_eos=True), "forever")
        reader = asyncio.create_task(collect(stream))
        await until(lambda: ae.snapshot.num_running == 1)
        await ae.shutdown(timeout_s=0.2)
        with pytest.raises(EngineUnavailableError, match="shut down"):
            await reader
        assert not ae.is_healthy and is_idle(ae)
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            ae.generate([1, 2], GREEDY, "late")

    asyncio.run(main())


# -- pure pieces --------------------------------------------------------------------------------------
def out(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], text, [], [], finished, "stop" if finished else None)


def test_delta_text_holds_back_stop_prefixes_and_partial_characters():
    d = DeltaText(stop=["\n\n", "END"])
    assert d.delta(out("Hello")) == "Hello"
    assert d.delta(out("Hello\n")) == ""  # could become "\n\n"
    assert d.delta(out("Hello\nworld E")) == "\nworld "  # "E" could start "END"
    assert d.delta(out("Hello\nworld E\ufffd")) == ""  # an incomplete UTF-8 character
    assert d.delta(out("Hello\nworld Eé", finished=True)) == "Eé"


@pytest.mark.parametrize("body,needle", [
    ('{"prompt": "x", "max_tokens": true}', "'max_tokens'"),
    ('{"prompt": "x"', "not valid JSON"),
    ('"just a string"', "must be a JSON object"),
])
def test_schema_errors_name_the_field(body, needle):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(body)
    assert needle in describe_validation_error(info.value)[0]


def test_chat_schema_accepts_text_parts_and_developer_role():
    req = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be "}, '
        '{"type": "text", "text": "brief."}]}, {"role": "user", "content": "Hi"}], "max_completion_tokens": 3}')
    assert req.template_messages()[0] == {"role": "system", "content": "Be \nbrief."}  # parts join with "\n", as in vLLM
    assert req.requested_max_tokens() == 3


class _VotingProposer:
    """Stands in for a composite proposer that exposes weights and per-draft statistics."""

    name = "vote"
    weights = {"ngram": 0.75, "small-lm": 0.25}
    draft_stats = {"ngram": {"drafted": 8, "accepted": 6}, "small-lm": SpecStats(num_drafted=4, num_accepted=1)}
    num_speculative_tokens = 5

    def set_num_speculative_tokens(self, n):
        self.num_speculative_tokens = n

    def propose(self, requests):
        return {}

    def observe(self, feedback):
        pass

    def release(self, request_id):
        pass


def test_metrics_expose_proposer_weights_and_per_draft_acceptance(model):
    async def main() -> str:
        engine = engine_for(model)
        engine.proposer = _VotingProposer()
        ae = AsyncEngine(engine, max_queue=4)
        metrics = ServerMetrics(ae)
        ae.start()
        out = [o async for o in ae.generate(random_prompts([5])[0], GREEDY, "m")][-1]
        metrics.observe_finished("completions", out)
        await ae.shutdown()
        return generate_latest(metrics.registry).decode()

    text = asyncio.run(main())
    for line in ['specfleet_draft_weight{draft="ngram"} 0.75', 'specfleet_draft_acceptance_rate{draft="ngram"} 0.75',
                 'specfleet_draft_acceptance_rate{draft="small-lm"} 0.25', "specfleet_spec_length 5.0",
                 "specfleet_kv_blocks_free 64.0", 'specfleet_requests_total{endpoint="completions",outcome="length"} 1.0',
                 "specfleet_generation_tokens_total 12.0"]:
        assert line in text, line


def test_streamed_requests_get_deltas_from_the_executor_not_whole_outputs(model):
    """Issue 44, item 13: a streamed request's step output is what that step added (O(new tokens)), not
    a copy of the whole output diffed afterwards (O(output) per step, O(n^2) per request on the engine
    thread); the stream still reassembles exactly the offline output."""
    prompts = random_prompts([5, 9])
    want = run_to_completion(engine_for(model, num_blocks=512), prompts, LONG)
    eng = engine_for(model, num_blocks=512)
    whole, sizes = [], []
    real_output, real_delta = eng.executor.output, eng.executor.delta

    def output(req):
        whole.append(req.request_id)
        return real_output(req)

    def delta(req):
        d = real_delta(req)
        sizes.append(len(d.token_ids))
        return d

    eng.executor.output, eng.executor.delta = output, delta

    async def main() -> list[RequestOutput]:
        ae = AsyncEngine(eng, max_queue=4)
        ae.start()
        outs = await asyncio.gather(*(collect(ae.generate(p, LONG, f"r{i}")) for i, p in enumerate(prompts)))
        await ae.shutdown()
        return [o[-1] for o in outs]

    got = asyncio.run(main())
    assert [o.token_ids for o in got] == [w.token_ids for w in want]
    assert whole == []  # no cumulative output was built for a streamed request
    assert sum(sizes) == sum(len(o.token_ids) for o in got) and max(sizes) <= 1  # no draft: one token a step
