"""Per-row losslessness on a real model (specfleet/bench/rowcheck.py): every row a verification step scores
equals, bit for bit, the plain decode step of its token on the same context, for the native SmolLM2-135M
GGUF and 24 real prompts from the bench datasets' shipped files, with chains and trees (gathered keys,
17+ rows), batches, prompts chunked by a small token budget, and preemption with recompute. The control:
the module-by-module path, whose prompt chunks attend in a split flash kernel, is caught."""
import dataclasses

import pytest
import torch

from specfleet.bench.rowcheck import RowChecker, RowReport, check_engine_run
from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.engine.engine import Engine
from specfleet.runtime.backends.native.forward import native_lib
from specfleet.runtime.backends.native import kernels as native_backend
from specfleet.runtime.formats import qtensor
from specfleet.sampling_params import SamplingParams
from specfleet.strategies.factory import SpecConfig, build_proposer
from tiny_engines import steady_fleets

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not native_backend.available(), reason=f"native kernels: {native_backend.unavailable_reason()}")]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# the CPU default's members (chains and the odd suffix-tree branch) and a cut model's best-first tree (gathered
# keys, 17+ rows). The fleet decides from step times whether speculation pays and how far to trim each tree; on
# the wall clock a busy host makes nodes look dear (a CI run drafted 2 tokens in 132 steps and accepted none, with
# margin=0.001: the margin gates plain decoding, not the trimming). So it runs on a steady clock (steady_fleets):
# a node costs nothing and no tree is trimmed, and the near-zero margin keeps drafting time (a call reads as a
# second too) from turning a step plain. It verifies every tree its members propose, whatever the host is doing
DRAFTS = ["fleet[margin=0.001](suffix,prompt-lookup)", "smollm2-135m-instruct@24[k=7,width=3,nodes=20]"]


@pytest.fixture(scope="module")
def smollm2():
    from tests.conftest import real_model_path
    from specfleet.runtime.loading.load import load_model

    path = real_model_path("smollm2-135m-instruct")
    model, tok = load_model(str(path), torch.float32, torch.device("cpu"), quantization="auto")
    assert native_lib(model, torch.zeros(1, dtype=torch.long), _kv(model)) is not None
    return model, tok


def _kv(model):
    from specfleet.runtime.kv.cache import KVCache

    return KVCache.allocate(model.config, 1, 16, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def prompts(smollm2):
    from specfleet.bench.datasets import iter_prompts, select

    _, tok = smollm2
    out = []
    for name in ("humaneval", "sharegpt", "chitchat"):
        source, is_chat = iter_prompts(name)

        def encode(p):
            if is_chat:
                return tok.encode(tok.apply_chat_template(p.as_messages(), tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False)
            return tok.encode(p.text)

        out += [encode(p) for p in select(source, 8, keep=lambda p: len(encode(p)) <= 160)]
    return out


def _engine(model, tok, draft, batch, budget=512, kv_tokens=None):
    """`kv_tokens`: a cache of about that many tokens (the engine keeps 64 of them for a draft tree)."""
    from specfleet.runtime.kv.cache import bytes_per_token

    proposer = build_proposer(draft, SpecConfig(), model.config.vocab_size, torch.float32, torch.device("cpu"),
                              quantization="auto", target_tokenizer=tok)
    steady_fleets(proposer)
    # small blocks in the tight cache: a request crosses into a new block every few tokens (and its blocks
    # scatter), so running requests outgrow the cache and are preempted
    block = 4 if kv_tokens else 16
    cache = CacheConfig(block, bytes_per_token(model.config, torch.float32) * (kv_tokens or batch * 256))
    return Engine(model, tok, EngineConfig(cache, SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=budget,
                                                                  mixed_step_factor=None)), proposer)


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    model, tok = smollm2
    outs, report = check_engine_run(_engine(model, tok, None, 8), prompts, GREEDY)
    assert report.rows_differing == 0, report.as_dict()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("draft", DRAFTS)
def test_every_verified_row_equals_its_decode_step(smollm2, prompts, plain, draft):
    model, tok = smollm2
    report, outs = RowReport(), [None] * len(prompts)
    # half the prompts 8 at a time with a 64-token budget (prompts prefilled in chunks beside verification), the
    # other half 8 at a time in a cache that holds the longest of them and 128 tokens more (preemption, recompute)
    longest = max(len(p) for p in prompts[1::2])
    for half, (budget, kv_tokens) in enumerate(((64, None), (512, longest + GREEDY.max_tokens + 64 + 64))):
        engine = _engine(model, tok, draft, 8, budget, kv_tokens)
        results, rep = check_engine_run(engine, prompts[half::2], GREEDY)
        report.merge(rep)
        outs[half::2] = [o.token_ids for o in results]
        # the counts in the message say which bound broke
        assert 0 < engine.stats.num_accepted < engine.stats.num_drafted, \
            f"{draft}, half {half}: accepted {engine.stats.num_accepted} of {engine.stats.num_drafted} drafted"
        if kv_tokens:
            assert sum(o.metrics["num_preemptions"] for o in results) > 0
    assert report.rows_differing == 0, report.as_dict()
    assert outs == plain
    routes = report.routes
    assert sum(v for k, v in routes.items() if "batch=2+" in k and "/node/" in k) > 0
    if draft != DRAFTS[0]:
        assert sum(v for k, v in routes.items() if "/gathered/" in k) > 0  # tree rows that skip their siblings
    if "nodes=20" in draft:
        assert sum(v for k, v in routes.items() if "rows=17+" in k and "/node/" in k) > 0


def test_the_checker_catches_a_row_that_takes_another_path(smollm2, prompts, request):
    """Control: the module-by-module forward (kept for dense models) attends to a prompt chunk with the
    split flash kernel, not as each row's decode step does; the checker must report those rows. It takes
    every prompt: an attention output off by an ulp shows in the logits only where it moves a value across
    an int8 rounding step of the next product's activations, which 3 prompts (7 rows) no longer did once
    the kernels' fp32 epilogue changed (measured with the 24 prompts cut to 200 tokens: 15 of 70 rows differ)."""
    model, tok = smollm2
    model.set_runtime(dataclasses.replace(model.runtime, fused_native=False))
    request.addfinalizer(lambda: model.set_runtime(dataclasses.replace(model.runtime, fused_native=True)))
    engine = _engine(model, tok, "fleet(suffix,prompt-lookup)", 3)
    checker = RowChecker.attach(engine)
    try:
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    finally:
        checker.detach()
    d = checker.report.as_dict()
    assert d["rows_differing"] > 0
    assert all("module/split/prompt-last" in r for r in d["differing_routes"])
