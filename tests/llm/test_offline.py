"""The offline API (specfleet/llm.py) on a tiny model: a rejected batch queues nothing, an abandoned
stream aborts its request, and neither leaks work into the next call."""
from __future__ import annotations

import pytest

from specfleet.errors import InvalidRequestError
from specfleet.llm import LLM
from specfleet.sampling_params import SamplingParams
from tiny_models import LetterTokenizer, ours_from_hf, random_prompts, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def mutated(**fields) -> SamplingParams:
    """Params made bad after construction (which validates), as a caller's reused object can be."""
    p = SamplingParams(temperature=0, max_tokens=6)
    for k, v in fields.items():
        setattr(p, k, v)
    return p


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.from_model(ours_from_hf(tiny_hf_model("llama")), LetterTokenizer(), "prompt-lookup", name="tiny",
                          dtype="float32", kv_cache_bytes=1 << 20, block_size=4)


@pytest.mark.parametrize("bad", [
    {"prompt": []},  # empty
    {"prompt": [5, 300]},  # outside the 97-token vocabulary
    {"prompt": [5, "x"]},  # not token ids
    {"params": mutated(temperature=-1.0)},
    {"params": mutated(max_tokens=0)},
    {"params": {"temperature": 0}},  # not a SamplingParams
])
def test_bad_kth_prompt_queues_none_of_the_batch(llm, bad):
    prompts = random_prompts([5, 7, 6])
    params = [GREEDY] * 3
    prompts[2] = bad.get("prompt", prompts[2])
    params[2] = bad.get("params", GREEDY)
    with pytest.raises(InvalidRequestError):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished()
    assert llm.engine.requests == {}
    good = random_prompts([4], seed=9)
    out = llm.generate(good, GREEDY)
    assert len(out) == 1 and out[0].prompt_token_ids == good[0]


def test_generate_interrupted_mid_run_leaves_nothing_queued(llm, monkeypatch):
    real_step, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts([5, 7]), GREEDY)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished()


def test_closed_or_dropped_stream_aborts_its_request(llm):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    stream = llm.stream(random_prompts([6])[0], params)
    next(stream)
    assert llm.engine.has_unfinished()
    stream.close()
    assert not llm.engine.has_unfinished()

    stream = llm.stream(random_prompts([6])[0], params)
    next(stream)
    del stream  # abandoned: collected at once, which closes it
    assert not llm.engine.has_unfinished()


def test_stream_to_the_end_equals_generate(llm):
    prompt = random_prompts([6], seed=3)[0]
    chunks = list(llm.stream(prompt, GREEDY))
    want = llm.generate([prompt], GREEDY)[0]
    assert chunks[-1][1].finished and chunks[-1][1].token_ids == want.token_ids


def test_from_model_wraps_the_model_as_it_is_and_names_it(monkeypatch):
    from specfleet import registry
    from specfleet.llm import DEFAULT_MODEL, default_draft

    # a tiny model under the default's name: the CPU default's 0.5B member (installed or not) could not draft for its
    # 97-token vocabulary, so the weightless default is what this checks
    real = registry.is_installed
    monkeypatch.setattr(registry, "is_installed", lambda n: False if "0.5b" in n else real(n))

    model = ours_from_hf(tiny_hf_model("llama"))
    plain = LLM.from_model(model, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    assert plain.model is model and plain.tokenizer is None
    assert plain.model_name == "custom" and plain.draft_name is None  # no default draft for a model of its own
    named = LLM.from_model(model, name=DEFAULT_MODEL, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    # as LLM(name), less the datastore: its corpus is text, and this model came without a tokenizer
    assert named.model is model and named.draft_name == default_draft(DEFAULT_MODEL, named.device, with_tokenizer=False)
    assert named.draft_name and "datastore" not in named.draft_name
    prompts = random_prompts([5, 7])
    assert ([o.token_ids for o in named.generate(prompts, GREEDY)]
            == [o.token_ids for o in plain.generate(prompts, GREEDY)])
    with pytest.raises(TypeError):
        LLM.from_model(model, model="tiny")  # the model is the one handed in


def test_a_runtime_config_reaches_every_module_and_changes_only_rounding():
    """LLM(..., runtime=RuntimeConfig(...)) hands the settings to the model, whose every linear layer and norm is
    routed by them (no module-level switch); outputs stay those of the default routes on a tiny fp32 model."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from specfleet.runtime.backends.cpu import weight_left_linear
    from specfleet.runtime.config import RuntimeConfig
    from specfleet.runtime.model.decoder import Linear, RMSNorm

    prompts = random_prompts([5, 7])
    default = LLM.from_model(ours_from_hf(tiny_hf_model("llama")), dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    runtime = dataclasses.replace(RuntimeConfig(), weight_left=False, upcast_rows=0, native_rows=0)
    other = LLM.from_model(ours_from_hf(tiny_hf_model("llama")), dtype="float32", kv_cache_bytes=1 << 20, block_size=4,
                           runtime=runtime)
    assert other.model.runtime is runtime and default.model.runtime is not runtime
    # every linear layer computes by its model's config: weight_left=False is torch's product, the default the
    # weight-left one (runtime/backends/cpu.py), on the same 3 rows
    torch.manual_seed(0)
    for model, weight_left in ((other.model, False), (default.model, True)):
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all(isinstance(m, RMSNorm) is False or m.route is None for m in model.modules())
        for m in linears:
            x = torch.randn(3, m.in_features)
            with torch.no_grad():
                want = weight_left_linear(x, m.weight, m.bias) if weight_left else F.linear(x, m.weight, m.bias)
                assert torch.equal(m(x), want)
    assert ([o.token_ids for o in other.generate(prompts, GREEDY)]
            == [o.token_ids for o in default.generate(prompts, GREEDY)])
    with pytest.raises(ValueError, match=">= 0"):
        RuntimeConfig(upcast_rows=-1)
