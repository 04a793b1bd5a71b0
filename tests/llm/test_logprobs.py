"""Log-probabilities from the engine (SamplingParams.logprobs / prompt_logprobs): they are the target's
own, so a speculative draft changes nothing, not even a bit; the prompt's come from the prefill rows
and line up with the tokens they score; and asking for none computes none."""
from __future__ import annotations

import math

import pytest

from specfleet.errors import InvalidRequestError
from specfleet.llm import LLM
from specfleet.sampling_params import SamplingParams
from tests.conftest import real_model_path
from tiny_models import ours_from_hf, random_prompts, tiny_hf_model

REPEATING = ("one two three four five six seven eight nine ten. one two three four five six seven eight nine ten. "
             "one two")
KW = dict(dtype="float32", max_model_len=384, kv_cache_bytes=24 << 20)


@pytest.fixture(scope="module")
def smollm2_pair():
    real_model_path("smollm2-135m-instruct")  # skips when it is not installed
    return LLM("smollm2-135m-instruct", None, **KW), \
        LLM("smollm2-135m-instruct", "prompt-lookup", num_speculative_tokens=3, **KW)


@pytest.mark.real_model
def test_logprobs_with_a_draft_equal_plain_decoding_bit_for_bit(smollm2_pair):
    plain, spec = smollm2_pair
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=3, prompt_logprobs=2)
    a, b = plain.generate(REPEATING, sp)[0], spec.generate(REPEATING, sp)[0]
    assert b.metrics["accepted"] > 0  # drafted tokens were accepted, so their logprobs came from verification rows
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(a.token_ids) and [lp.token_id for lp in a.logprobs] == a.token_ids
    assert a.logprobs == b.logprobs  # every float and every alternative, exactly
    assert a.prompt_logprobs == b.prompt_logprobs
    for lp in a.logprobs:  # greedy: each token is its row's most likely one
        assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


@pytest.mark.real_model
def test_prompt_logprobs_score_the_prompt_tokens_and_match_decoding(smollm2_pair):
    plain, _ = smollm2_pair
    gen = plain.generate(REPEATING, SamplingParams(temperature=0, max_tokens=6, logprobs=0))[0]
    # teacher forcing: the generated tokens, now part of a prompt, get nearly the same numbers from the
    # prefill rows as they got as decode steps (the quantized model's prefill and decode kernels differ
    # by a few 1e-3; a row off by one would differ by whole units)
    ids = gen.prompt_token_ids + gen.token_ids
    forced = plain.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    assert forced.prompt_logprobs[0] is None and len(forced.prompt_logprobs) == len(ids)
    assert [lp.token_id for lp in forced.prompt_logprobs[1:]] == ids[1:]
    tail = forced.prompt_logprobs[len(gen.prompt_token_ids):]
    assert [lp.logprob for lp in tail] == pytest.approx([lp.logprob for lp in gen.logprobs], abs=2e-2)
    assert gen.logprobs[0].top == []  # logprobs=0: the token's own only
    assert all(lp.logprob <= 0 and len(lp.top) == 1 for lp in forced.prompt_logprobs[1:])


def tiny_llm(**kw) -> LLM:
    model = ours_from_hf(tiny_hf_model("llama"))
    return LLM.from_model(model, None, None, dtype="float32", kv_cache_bytes=1 << 20, block_size=4, **kw)


def test_prompt_logprobs_survive_chunked_prefill():
    prompt = random_prompts([40])[0]
    whole = tiny_llm().generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    chunked = tiny_llm(max_num_batched_tokens=7).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    assert len(whole.prompt_logprobs) == len(chunked.prompt_logprobs) == 40
    assert [lp.token_id for lp in chunked.prompt_logprobs[1:]] == prompt[1:]
    for x, y in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
    one = tiny_llm().generate([prompt[:1]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert one.prompt_logprobs == [None]


def test_sampled_logprobs_are_of_the_sampled_tokens_and_normalized():
    out = tiny_llm().generate([random_prompts([5])[0]],
                              SamplingParams(temperature=1.0, seed=1, max_tokens=8, logprobs=5, ignore_eos=True))[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for lp in out.logprobs:
        top = dict(lp.top)
        assert lp.token_id not in top or top[lp.token_id] == lp.logprob
        assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-5


def test_no_logprobs_asked_none_returned_and_bounds_checked():
    out = tiny_llm().generate([random_prompts([5])[0]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.logprobs is None and out.prompt_logprobs is None
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(InvalidRequestError, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_logprobs_survive_preemption():
    """A preempted request recomputes its prompt and output as one long prompt: no prompt token is
    scored twice, no output token loses or repeats its entry, and the numbers match a roomy run."""
    from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
    from specfleet.engine.engine import Engine
    from tiny_models import run_to_completion

    model = ours_from_hf(tiny_hf_model("qwen2"))
    c = model.config
    block_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 4  # fp32, 4 slots a block

    def engine(num_blocks: int, **sched) -> Engine:
        return Engine(model, None, EngineConfig(CacheConfig(4, block_bytes * num_blocks), SchedulerConfig(**sched)))

    prompts = random_prompts([25, 18, 30, 11, 27, 16])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    roomy = run_to_completion(engine(256), prompts, sp)
    squeezed = run_to_completion(engine(40, max_num_batched_tokens=16), prompts, sp)
    assert sum(o.metrics["num_preemptions"] for o in squeezed) > 0
    for a, b, p in zip(roomy, squeezed, prompts):
        assert b.token_ids == a.token_ids and [lp.token_id for lp in b.logprobs] == b.token_ids
        assert [lp.token_id for lp in b.prompt_logprobs[1:]] == p[1:] and len(b.prompt_logprobs) == len(p)
        assert [lp.logprob for lp in b.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-5)
        assert [lp.logprob for lp in b.prompt_logprobs[1:]] == \
            pytest.approx([lp.logprob for lp in a.prompt_logprobs[1:]], abs=1e-5)


def test_no_extra_logit_rows_unless_prompt_logprobs_are_asked_for():
    """Plain requests ask the runner for exactly the rows they verify (the last prompt row, then one
    per step); prompt_logprobs adds one row per prompt token after the first, once."""
    llm = tiny_llm(max_num_batched_tokens=8)
    runner = llm.engine.runner
    rows: list[int] = []
    real = runner.execute

    def counting(items, blocks=None):
        rows.append(sum(len(it.logit_indices) for it in items))
        return real(items, blocks)
    runner.execute = counting
    prompt = random_prompts([20])[0]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3))
    assert sum(rows) == 4  # 20 prompt tokens in three chunks: rows only for the four emitted tokens
    rows.clear()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0))
    assert sum(rows) == 4 + 19
