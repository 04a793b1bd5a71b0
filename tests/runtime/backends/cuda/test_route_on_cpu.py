"""The CUDA route of the runtime, run on the CPU (tests/cuda_route.py: the routing forced, the three Triton
kernels replaced by row-by-row stand-ins that are one operator each). CI has no GPU; these pin what a GPU
step asks for, so a regression fails here and not first on a lent GPU:

- a speculative step (a k=4 draft to verify for every request) at batch 1 and 16 waits on the device nowhere, moves its
  results to the host once, and dispatches at most about as many operations as a plain step (the step's key
  plan goes over in one copy; one attention call per layer for decode, verification and prompt rows);
- tree verification on this route gives plain greedy output and every verified row equals its own decode
  step bit for bit (bench/rowcheck.py), for a tree draft model, a lookup tree and a chain;
- every tensor the route builds during a step is made on the model's device: the steps run with the default
  device set to `meta`, so a tensor made without naming its device (the `torch.arange(c)` concatenated with
  a CUDA tensor that once broke tree verification on GPUs) fails the step.
"""

import pytest
import torch

from cuda_route import route_cuda_on_cpu
from specfleet.bench.rowcheck import check_engine_run
from tests.runtime.backends.cuda.test_on_gpu import _engine, _proposer, captured_ahead_against_lazy, graphs_against_eager
from tests.engine.test_dispatch_counts import _step_counts
from tiny_engines import LENGTHS, repetitive_prompts
from tiny_models import ours_from_hf, perturbed_copy, run_to_completion, tiny_hf_model
from specfleet.sampling_params import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture
def routed(monkeypatch):
    route_cuda_on_cpu(monkeypatch)


@pytest.mark.parametrize("batch", [1, 16])
def test_a_speculative_step_on_the_cuda_route_costs_about_a_plain_step(routed, batch, monkeypatch):
    counts = {}
    for k in (0, 4):
        for layers in (2, 4):
            total, syncs, transfers = _step_counts(batch, k, layers, monkeypatch)
            assert syncs == {}, (k, layers, syncs)
            assert transfers <= 1, (k, layers, transfers)  # the step's argmax, once, for every request
            counts[k, layers] = total
    per_layer = {k: (counts[k, 4] - counts[k, 2]) / 2 for k in (0, 4)}
    assert per_layer[4] <= 1.25 * per_layer[0], per_layer  # one attention call per layer, whatever the rows
    assert counts[4, 2] <= 2 * counts[0, 2], counts


@pytest.fixture(scope="module")
def pair():
    target = ours_from_hf(tiny_hf_model("qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=3))
    return target.eval(), perturbed_copy(target, 0.15).eval()


def _cpu_engine(model, proposer=None, budget=512):
    return _engine(model, proposer, budget=budget, device=CPU)  # the engines test_cuda builds, on the CPU


def _cpu_proposer(kind, draft):
    return _proposer(kind, draft, CPU)


@pytest.mark.parametrize("kind", ["draft-tree", "lookup-tree", "draft-chain"])
def test_tree_verification_on_the_cuda_route_is_lossless_row_by_row(routed, pair, kind):
    target, draft = pair
    prompts = repetitive_prompts(LENGTHS[3])
    plain = run_to_completion(_cpu_engine(target), prompts, GREEDY)
    eng = _cpu_engine(target, _cpu_proposer(kind, draft), budget=32)
    assert eng.runner._cuda  # the route under test: the key plan, DevicePlan, one attention call per layer
    outs, report = check_engine_run(eng, prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert eng.stats.num_drafted > 0 and report.rows_checked > 30
    assert report.rows_differing == 0, report.as_dict()


@pytest.mark.parametrize("kind", ["draft-tree", "lookup-tree"])
def test_the_cuda_route_makes_every_tensor_on_the_models_device(routed, pair, kind, monkeypatch):
    from specfleet.runtime.backends.cuda import kernels as cuda_kernels

    target, draft = pair
    prompts = repetitive_prompts(LENGTHS[3])
    plain = run_to_completion(_cpu_engine(target), prompts, GREEDY)

    def run() -> list[list[int]]:
        eng = _cpu_engine(target, _cpu_proposer(kind, draft))
        ids = [eng.add_request(p, GREEDY).request_id for p in prompts]
        outs = {}
        with torch.device("meta"):  # a tensor made without its device lands on meta and the step fails
            while eng.has_unfinished():
                outs.update((o.request_id, o.token_ids) for o in eng.step() if o.finished)
        assert eng.stats.num_drafted > 0
        return [outs[i] for i in ids]

    assert run() == [o.token_ids for o in plain]
    # control: the same route with one tensor made without its device (as torch.arange(c) once was) fails
    attend = cuda_kernels.attend
    monkeypatch.setattr(cuda_kernels, "attend", lambda q, *a: attend(q, *a) + torch.zeros(q.shape[-1]))
    with pytest.raises(Exception, match="device"):
        run()


@pytest.mark.parametrize("kind,batch", [(None, 3), (None, 8), ("draft-chain", 3), ("draft-tree", 3),
                                        ("lookup-tree", 1), ("lookup-tree", 3)])
def test_step_graphs_give_the_eager_steps_tokens_and_bits(routed, pair, kind, batch):
    """RuntimeConfig.cuda_graphs: decode, chain drafting, and chain and tree verification steps go through
    runtime/backends/cuda/graphs.py's padded static buffers (captured on a GPU; run eagerly here, which checks the
    padding, the static plan with a tree's extra keys, and the row layout): the same tokens as the eager route,
    every verified row equal to its decode step, and the padded path really taken."""
    eng, prompts = graphs_against_eager(*pair, kind, batch, device=CPU)
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.replays > 0
    if kind == "draft-chain":  # its verification steps and the draft model's chain steps too
        assert graphs.replays > len(prompts) and eng.proposer.runner.graphs.replays > 0
    if kind == "lookup-tree":  # branched trees, and at batch 3 trees of different sizes padded to the largest
        assert graphs.tree_replays > 0 and (batch == 1 or graphs.ragged_replays > 0)
    assert graphs.captures == 0  # the CPU runs the padded forward eagerly: nothing is captured
    from specfleet.runtime.backends.cuda.graphs import NEW_BUCKETS

    assert {n for _, n, _ in graphs._shapes} <= set(NEW_BUCKETS)  # n rounded up: fewer shapes to capture
    if kind == "draft-chain":  # k=4 chains verify 5 rows: padded to 6, rows gathered back (the bits checked above)
        assert (4, 6, 6) in graphs._shapes and graphs.ragged_replays > 0


def test_step_graphs_keep_their_outputs_within_the_memory_plan(routed, pair):
    """Issue 44, item 9: each captured shape keeps its logits (and hidden states) allocated; together they
    stay within RuntimeConfig.cuda_graph_bytes, and a shape that does not fit runs eagerly with the same
    tokens. The plan is the same code on the CPU route as on a GPU."""
    import copy
    import dataclasses

    target, _ = pair
    batches = [repetitive_prompts(LENGTHS[3]), repetitive_prompts(LENGTHS[3])[:1]]  # shapes (4, 1, 1), (1, 1, 1)

    def run(graphs: bool, **budget):
        eng = _cpu_engine(copy.deepcopy(target).set_runtime(dataclasses.replace(target.runtime, cuda_graphs=graphs,
                                                                                **budget)))
        return eng, [[o.token_ids for o in run_to_completion(eng, prompts, GREEDY)] for prompts in batches]

    _, eager = run(False)
    probe, _ = run(True)
    unbounded = probe.runner.graphs
    assert len(unbounded._shapes) >= 2  # unbounded, every shape keeps its buffers
    one = max(unbounded.shape_bytes(k) for k in unbounded._shapes)
    eng, outs = run(True, cuda_graph_bytes=one)
    graphs = eng.runner.graphs
    assert outs == eager
    assert graphs.planned_bytes <= one and len(graphs._shapes) == 1
    assert graphs.replays > 0 and graphs.over_budget > 0 and sum(unbounded.shape_bytes(k) for k in unbounded._shapes) > one


def test_graph_shapes_captured_ahead_leave_no_trace(routed, pair):
    """Engine.capture_graphs: the shapes of plain decoding and verification (padded batches up to max_num_seqs,
    n up to max_new) are made before any request, on scratch requests whose blocks are freed after; then the
    requests' steps find their shapes made, and their tokens and every verified row are what an engine that made
    them as it went gives (the scratch steps wrote only to their own freed blocks)."""
    from specfleet.runtime.backends.cuda.graphs import NEW_BUCKETS

    eng, made, shapes, _ = captured_ahead_against_lazy(*pair, device=CPU)
    # max_num_seqs 8: batches 1, 2, 4, 8; n 1, 2, 3, 4 and 6 (for 5)
    assert made == len(shapes) == 4 * len([n for n in NEW_BUCKETS if n <= 6]) == 20
    assert {k for k in eng.runner.graphs._shapes if k[2] == k[1]} <= set(shapes)  # none made as it went (but last-row)
    with pytest.raises(RuntimeError, match="before any request"):
        eng.add_request([1, 2, 3], GREEDY)
        eng.capture_graphs()
