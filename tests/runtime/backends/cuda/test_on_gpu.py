"""The CUDA path on a real GPU (every test here is skipped without one; CI has none, the device tool lends one
to some sessions): speculative greedy output equals plain greedy output for chains and branched trees at
batch 1/3/8 in fp32 and bf16, every verified row's logits equal its own decode step's bit for bit (checked
row by row with bench/rowcheck.py), sampled speculation runs, no tensor is left on the host, and the step's
synchronisations stay bounded. A real GGUF model runs too when SPECFLEET_CUDA_MODEL names its file."""
import os

import pytest
import torch

from specfleet.bench.rowcheck import check_engine_run
from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specfleet.engine.engine import Engine
from specfleet.sampling_params import SamplingParams
from tiny_engines import LENGTHS, repetitive_prompts
from tiny_models import ours_from_hf, perturbed_copy, run_to_completion, tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = torch.device("cuda")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _on_cuda(model, dtype):
    return model.to(device=CUDA, dtype=dtype).eval()


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def pair(request):
    hf = tiny_hf_model("qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=3)
    target = ours_from_hf(hf)
    draft = perturbed_copy(target, 0.15)
    return _on_cuda(target, request.param), _on_cuda(draft, request.param)


def _engine(model, proposer=None, batch=8, budget=512, device=CUDA):
    cache = CacheConfig(16, 32 << 20)
    return Engine(model, None, EngineConfig(cache, SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=budget,
                                                                   mixed_step_factor=None)), proposer, device)


def _proposer(kind, draft, device=CUDA):
    small = 4 << 20
    if kind == "draft-chain":
        return DraftModelProposer(draft, "draft", DraftModelConfig(4, kv_cache_bytes=small), device=device)
    if kind == "draft-tree":
        return DraftModelProposer(draft, "draft", DraftModelConfig(4, top_children=3, max_nodes=20,
                                                                   kv_cache_bytes=small), device=device)
    if kind == "fleet":
        from specfleet.strategies.fleet import FleetProposer

        return FleetProposer([PromptLookupProposer(PromptLookupConfig(4, min_ngram=1, num_branches=3)),
                              DraftModelProposer(draft, "draft", DraftModelConfig(4, kv_cache_bytes=small), device=device)])
    return PromptLookupProposer(PromptLookupConfig(4, min_ngram=1, num_branches=3))


def graphs_against_eager(target, draft, kind, batch, device=CUDA):
    """The same prompts with RuntimeConfig.cuda_graphs off and on (on copies of the models): the tokens must
    be the eager steps' and every verified row its decode step's. Returns the engine that ran with graphs."""
    import copy
    import dataclasses

    def with_graphs(model, on):
        return copy.deepcopy(model).set_runtime(dataclasses.replace(model.runtime, cuda_graphs=on))

    prompts = repetitive_prompts(LENGTHS[batch])
    plain = _engine(with_graphs(target, False), device=device)
    eager = run_to_completion(plain, prompts, GREEDY)
    assert plain.runner.graphs is None  # the baseline really launched every step
    proposer = None if kind is None else _proposer(kind, with_graphs(draft, True), device)
    eng = _engine(with_graphs(target, True), proposer, budget=32 if kind else 512, device=device)
    outs, report = check_engine_run(eng, prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert report.rows_differing == 0, report.as_dict()
    return eng, prompts


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("kind", ["draft-chain", "draft-tree", "lookup-tree"])
def test_speculative_greedy_equals_plain_greedy_on_cuda(pair, kind, batch):
    target, draft = pair
    prompts = repetitive_prompts(LENGTHS[batch])
    plain = run_to_completion(_engine(target), prompts, GREEDY)
    eng = _engine(target, _proposer(kind, draft))
    spec = run_to_completion(eng, prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert 0 < eng.stats.num_accepted <= eng.stats.num_drafted
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("kind", ["draft-chain", "draft-tree", "lookup-tree"])
def test_every_verified_row_equals_its_decode_step_on_cuda(pair, kind):
    """Row by row, bit for bit: each verification row (chains, trees of 17+ rows, batches of 8, prompts
    chunked by a 32-token budget beside verification) against a decode step of batch one."""
    target, draft = pair
    prompts = repetitive_prompts(LENGTHS[8])
    outs, report = check_engine_run(_engine(target, _proposer(kind, draft), budget=32), prompts, GREEDY)
    assert report.rows_checked > 100
    assert report.rows_differing == 0, report.as_dict()
    plain = run_to_completion(_engine(target), prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_sampled_speculation_runs_and_is_seeded_on_cuda(pair):
    target, draft = pair
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True)
    prompts = repetitive_prompts(LENGTHS[3])
    a = run_to_completion(_engine(target, _proposer("draft-tree", draft)), prompts, params)
    b = run_to_completion(_engine(target, _proposer("draft-tree", draft)), prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 24 for o in a)


def test_kv_cache_and_step_tensors_live_on_the_gpu(pair):
    target, draft = pair
    eng = _engine(target, _proposer("draft-tree", draft))
    run_to_completion(eng, repetitive_prompts(LENGTHS[3]), GREEDY)
    kv = eng.executor.runner.kv
    assert all(t.is_cuda for t in kv.k) and all(t.is_cuda for t in kv.v)
    assert all(p.is_cuda for p in target.parameters())


@pytest.mark.parametrize("kind,batch", [("draft-chain", 8), ("draft-chain", 16), ("draft-tree", 8),
                                        ("lookup-tree", 16)])
def test_a_speculative_step_synchronises_a_bounded_number_of_times(pair, kind, batch):
    """Device-to-host waits per step (CUDA's sync debug mode warns at each) do not grow with rows or layers:
    the step's host data goes over in one non-blocking copy and the target's argmax comes back once. A
    chain draft model reads its argmax once per drafted position for the whole batch; a tree draft model
    still drafts each request's tree alone (one read per level per request)."""
    import collections
    import traceback
    import warnings

    target, draft = pair
    eng = _engine(target, _proposer(kind, draft), batch=batch)
    prompts = repetitive_prompts((LENGTHS[8] * 2)[:batch])
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            ours = [f for f in traceback.extract_stack() if "/specfleet/" in f.filename]
            sites[f"{ours[-1].filename.rsplit('/specfleet/', 1)[-1]}:{ours[-1].lineno}" if ours else "?"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = sum(sites.values())
    print(f"{kind} batch {batch}: synchronising calls per step by site:", dict(sites.most_common()))
    k = 4
    bound = {"draft-chain": k + 2, "draft-tree": k * batch + 2, "lookup-tree": 2}[kind]
    assert syncs <= bound, sites.most_common(8)


@pytest.fixture(scope="module")
def real_model():
    path = os.environ.get("SPECFLEET_CUDA_MODEL")
    if not path:
        pytest.skip("SPECFLEET_CUDA_MODEL names no GGUF file")
    from specfleet.runtime.loading.load import load_model

    return load_model(path, torch.bfloat16, CUDA, quantization="auto")


@pytest.mark.parametrize("draft", ["fleet(suffix,prompt-lookup)", "ngram"])
def test_real_model_rows_equal_their_decode_steps_on_cuda(real_model, draft):
    from specfleet.bench.datasets import iter_prompts, select
    from specfleet.strategies.factory import SpecConfig, build_proposer

    model, tok = real_model
    source, _ = iter_prompts("humaneval")
    prompts = [tok.encode(p.text) for p in select(source, 8)]
    proposer = build_proposer(draft, SpecConfig(), model.config.vocab_size, torch.bfloat16, CUDA,
                              quantization="auto", target_tokenizer=tok)
    eng = Engine(model, tok, EngineConfig(CacheConfig(16, 1 << 30), SchedulerConfig(max_num_seqs=8)), proposer, CUDA)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs, report = check_engine_run(eng, prompts, params)
    plain = run_to_completion(Engine(model, tok, EngineConfig(CacheConfig(16, 1 << 30), SchedulerConfig(max_num_seqs=8)),
                                     None, CUDA), prompts, params)
    assert report.rows_differing == 0, report.as_dict()
    assert eng.stats.num_drafted > 0 and report.rows_checked > len(prompts) * params.max_tokens
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


@pytest.mark.parametrize("kind,batch", [(None, 3), (None, 8), ("draft-chain", 3), ("draft-chain", 8),
                                        ("lookup-tree", 1), ("lookup-tree", 3)])
def test_step_graphs_replay_the_eager_steps_bits_on_cuda(pair, kind, batch):
    """RuntimeConfig.cuda_graphs: decode, chain drafting, and chain and tree verification replay captured CUDA
    graphs (runtime/backends/cuda/graphs.py); the tokens are the eager steps' and every verified row equals its
    decode step."""
    eng, prompts = graphs_against_eager(*pair, kind, batch)
    graphs = eng.runner.graphs
    assert graphs.replays > len(prompts) and all(s.graph is not None for s in graphs._shapes.values())
    assert 0 < eng.stats.warmup_steps <= graphs.captures == len(graphs._shapes)
    if kind == "lookup-tree":  # at batch 3, trees of different sizes padded to the largest
        assert graphs.tree_replays > 0 and (batch == 1 or graphs.ragged_replays > 0)


@pytest.mark.parametrize("batch", [3, 8])
def test_the_fleet_prices_padded_rows_where_graphs_pad_on_cuda(pair, batch):
    """With CUDA graphs a ragged batch runs padded to its widest request (runtime/backends/cuda/graphs.py): the
    engine tells the fleet (StepTiming.padded_rows), which then prices a step by its width; the tokens stay the
    eager steps' and every verified row its decode step's."""
    eng, prompts = graphs_against_eager(*pair, "fleet", batch)
    assert eng.runner.pads_ragged and eng.proposer.padded and eng.proposer.fleet_report()["padded_rows"]
    assert eng.stats.num_drafted > 0


def captured_ahead_against_lazy(target, draft, device=CUDA):
    """Two engines with graphs on the same prompts (batch 3, a k=4 draft chain): one captures its shapes as it goes,
    the other first runs Engine.capture_graphs(max_new=5) (scratch requests, their blocks freed after). The tokens
    and every verified row must be the same. Returns (the second engine, shapes made ahead, those shapes, graphs
    captured by then)."""
    import copy
    import dataclasses

    def with_graphs(model):
        return copy.deepcopy(model).set_runtime(dataclasses.replace(model.runtime, cuda_graphs=True))

    prompts = repetitive_prompts(LENGTHS[3])

    def engine():
        return _engine(with_graphs(target), _proposer("draft-chain", with_graphs(draft), device), budget=32,
                       device=device)

    want, _ = check_engine_run(engine(), prompts, GREEDY)
    eng = engine()
    free = eng.blocks.num_free_blocks
    made = eng.capture_graphs(max_new=5)
    graphs = eng.runner.graphs
    shapes, captured = list(graphs._shapes), graphs.captures
    assert eng.blocks.num_free_blocks == free and not eng.requests
    outs, report = check_engine_run(eng, prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert report.rows_differing == 0 and report.rows_checked > 0
    return eng, made, shapes, captured


def test_shapes_captured_ahead_serve_the_first_requests_on_cuda(pair):
    """Engine.capture_graphs captures decode and verification shapes before any request (scratch requests,
    blocks freed): the first requests then replay them (no verification shape captured while they run), with
    the tokens and row bits of an engine that captured as it went."""
    eng, made, shapes, captured = captured_ahead_against_lazy(*pair)
    assert made == captured == len(shapes) > 0
    assert all(k[2] != k[1] for k in list(eng.runner.graphs._shapes)[made:])  # later: last-row (prompt) shapes only
