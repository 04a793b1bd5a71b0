"""What one engine step asks of the device, counted with a TorchDispatchMode on the module path (the route a
CUDA model takes; here on CPU tensors): the operations of a plain decode step and of a k=4 speculative step
at batch 1 and 16, with 2 and with 4 layers. Pinned so that a regression fails CI:

- no operation that waits on the device (`item`/`bool`/`int` of a tensor, `nonzero`, ...) inside a step:
  masks and row layouts are host data, decided in numpy before anything is sent (attention.row_keys);
- host transfers of results (`tolist`) at most one per request per step, never per layer or per row;
- operations per layer of a speculative step at batch 16 within 3.5x a plain step's. This is the torch
  module path of dense CPU models, where each verification row attends in its own call, as its decode
  step does, which is what keeps it bit for bit there. The CUDA route (one batch-invariant attention call
  per layer for every row) is pinned by tests/runtime/backends/cuda/test_route_on_cpu.py: there a speculative step costs about a
  plain step.
"""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.core.tree import DraftTree
from specfleet.engine.engine import Engine
from specfleet.sampling_params import SamplingParams
from tiny_models import ours_from_hf, random_prompts, tiny_hf_model

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Chain:
    """A draft of k fixed tokens for every request at every step (a tree the verifier must walk)."""

    name = "chain"

    def __init__(self, k):
        self.k = k

    def propose(self, requests):
        return {r.request_id: DraftTree.chain([1] * self.k, self.name) for r in requests}

    def observe(self, feedback):
        pass

    def release(self, request_id):
        pass


def _step_counts(batch: int, k: int, layers: int, monkeypatch) -> tuple[int, dict, int]:
    model = ours_from_hf(tiny_hf_model("llama", num_hidden_layers=layers))
    eng = Engine(model, None, EngineConfig(CacheConfig(16, 64 << 20), SchedulerConfig()), _Chain(k) if k else None)
    for p in random_prompts([20] * batch):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):  # prompts prefilled; every request now decodes (and verifies a draft when k > 0)
        eng.step()
    transfers = []
    real_tolist = torch.Tensor.tolist
    torch.Tensor.tolist = lambda self: transfers.append(1) or real_tolist(self)
    count = _Count()
    try:
        with count:
            eng.step()
    finally:
        torch.Tensor.tolist = real_tolist
    syncs = {op: n for op, n in count.ops.items() if op in SYNC_OPS}
    return sum(count.ops.values()), syncs, len(transfers)


@pytest.mark.parametrize("batch", [1, 16])
def test_a_step_never_waits_on_the_device_and_transfers_once_per_request(batch, monkeypatch):
    for k in (0, 4):
        for layers in (2, 4):
            _, syncs, transfers = _step_counts(batch, k, layers, monkeypatch)
            assert syncs == {}, (batch, k, layers, syncs)
            assert transfers <= batch, (batch, k, layers, transfers)


def test_a_speculative_step_costs_a_bounded_number_of_operations_per_layer(monkeypatch):
    plain = [_step_counts(16, 0, layers, monkeypatch)[0] for layers in (2, 4)]
    spec = [_step_counts(16, 4, layers, monkeypatch)[0] for layers in (2, 4)]
    per_layer_plain = (plain[1] - plain[0]) / 2
    per_layer_spec = (spec[1] - spec[0]) / 2
    assert per_layer_spec <= 3.5 * per_layer_plain, (per_layer_spec, per_layer_plain)
