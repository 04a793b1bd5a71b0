"""Plain continuous batching: greedy equality with transformers, preemption, chunking, stops, errors."""
import pytest
import torch

from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.engine.engine import Engine
from specfleet.errors import InvalidRequestError
from specfleet.sampling_params import SamplingParams
from tiny_models import ours_from_hf, random_prompts, run_to_completion, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tokens_per_block_bytes(model, block_size):
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * block_size


def engine_for(model, num_blocks=256, block_size=4, **sched):
    cache = CacheConfig(block_size, tokens_per_block_bytes(model, block_size) * num_blocks)
    return Engine(model, None, EngineConfig(cache, SchedulerConfig(**sched)))


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_greedy_equals_transformers(arch):
    hf = tiny_hf_model(arch)
    prompts = random_prompts([5, 17, 9, 30, 3, 12, 8, 21])
    outs = run_to_completion(engine_for(ours_from_hf(hf)), prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 24)
        assert o.finish_reason == "length"


def test_preemption_and_chunked_prefill_do_not_change_output():
    hf = tiny_hf_model("qwen2")
    model = ours_from_hf(hf)
    prompts = random_prompts([25, 18, 30, 11, 27, 16])
    roomy = run_to_completion(engine_for(model), prompts, GREEDY)
    # 20 blocks of 4 slots cannot hold six ~50-token requests at once; a 16-token budget chunks prompts
    tight = engine_for(model, num_blocks=40, max_num_batched_tokens=16)
    squeezed = run_to_completion(tight, prompts, GREEDY)
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    assert sum(o.metrics["num_preemptions"] for o in squeezed) > 0
    assert tight.blocks.num_free_blocks == tight.blocks.num_blocks


def test_requests_join_and_leave_between_steps():
    hf = tiny_hf_model("llama")
    eng = engine_for(ours_from_hf(hf))
    prompts = random_prompts([7, 12, 5])
    first = eng.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(2):
        eng.step()
    late = eng.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done[first.request_id].token_ids == hf_greedy(hf, prompts[0], 3)
    assert done[late.request_id].token_ids == hf_greedy(hf, prompts[1], 10)


def test_abort_frees_blocks_and_others_continue():
    hf = tiny_hf_model("qwen2")
    eng = engine_for(ours_from_hf(hf))
    prompts = random_prompts([10, 14])
    a = eng.add_request(prompts[0], GREEDY)
    b = eng.add_request(prompts[1], GREEDY)
    eng.step()
    eng.step()
    eng.abort(a.request_id)
    assert a.finish_reason == "abort"
    done = [o for _ in range(100) for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == [b.request_id]
    assert done[0].token_ids == hf_greedy(hf, prompts[1], 24)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_stop_token_and_eos_end_at_the_right_token():
    hf = tiny_hf_model("qwen2")
    model = ours_from_hf(hf)
    prompt = random_prompts([9])[0]
    ref = hf_greedy(hf, prompt, 24)
    stop_tok = ref[5]
    cut = ref.index(stop_tok) + 1
    out = run_to_completion(engine_for(model), [prompt],
                            SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok], ignore_eos=True))
    assert out[0].token_ids == ref[:cut] and out[0].finish_reason == "stop"


def test_context_end_finishes_with_length():
    hf = tiny_hf_model("llama")
    eng = engine_for(ours_from_hf(hf), max_model_len=20)
    out = run_to_completion(eng, random_prompts([15]), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert len(out[0].token_ids) == 5 and out[0].finish_reason == "length"


def test_bad_requests_get_clear_errors_and_engine_keeps_working():
    hf = tiny_hf_model("llama")
    eng = engine_for(ours_from_hf(hf), max_model_len=32)
    with pytest.raises(InvalidRequestError, match="context holds 32"):
        eng.add_request(list(range(40)), GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        eng.add_request([1, 2, 500], GREEDY)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    out = run_to_completion(eng, random_prompts([6]), GREEDY)
    assert out[0].token_ids == hf_greedy(hf, random_prompts([6])[0], 24)


def test_seeded_sampling_is_reproducible():
    hf = tiny_hf_model("qwen2")
    model = ours_from_hf(hf)
    prompts = random_prompts([8, 8])
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    a = run_to_completion(engine_for(model), prompts, p)
    b = run_to_completion(engine_for(model), prompts[::-1], p)
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids
