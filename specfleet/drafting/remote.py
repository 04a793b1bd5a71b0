"""Draft workers outside the engine's process: Ray actors, each with its own draft model and KV cache.

The boundary is the pipeline's: a drafter thread in the engine hands the requests it claimed to its
proposer; here that proposer is a `RemoteProposer`, which sends each request's *new* tokens to its
actor (the worker keeps the token lists it has seen, so a decode step costs a few ints, not the
whole context) and gets draft trees back. observe/release go out as actor calls from that same
thread, and Ray runs one caller's calls on an actor in the order they were made, so a release never
overtakes the draft before it. The engine thread only waits on the pool, never on Ray.

A worker loads its draft by registered name or path, or builds it from a config and state dict sent
over (tiny test models). Ray is optional: `pip install 'specfleet[pipeline]'`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from specfleet.extras import require
from specfleet.runtime.loading.build import parse_device, parse_dtype
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.runtime.model.config import ModelConfig
from specfleet.runtime.formats.quant import quantize_model
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.core.proposer import Feedback, RequestSnapshot, RequestView
from specfleet.core.tree import DraftTree


def require_ray():
    return require("ray", "pipeline", "remote draft workers")


@dataclass(frozen=True)
class RemoteDraftSpec:
    name: str  # registered model name or checkpoint path ("NAME@N" keeps N layers); also the origin label
    config: DraftModelConfig = field(default_factory=DraftModelConfig)
    dtype: str = "float32"
    device: str = "cpu"
    target_vocab_size: int | None = None
    num_threads: int | None = 1  # torch intra-op threads in the worker process
    quantization: str | None = None  # "int8": weight-only int8 in the worker (runtime/formats/quant.py)
    # instead of loading by name: a model sent over as its config and state dict (tiny test models)
    model_config: ModelConfig | None = None
    state_dict: dict[str, torch.Tensor] | None = None

    @classmethod
    def from_model(cls, model: DecoderLM, name: str, config: DraftModelConfig | None = None,
                   **kw) -> "RemoteDraftSpec":
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return cls(name, config or DraftModelConfig(), dtype, model_config=model.config, state_dict=weights, **kw)


@dataclass(frozen=True)
class RequestDelta:
    """What a worker needs to draft one request: the tokens it has not seen yet."""

    request_id: str
    start: int  # tokens the worker already holds for this request
    token_ids: list[int]
    params: SamplingParams | None  # sent with the first delta only


class DraftWorker:
    """The actor's body: a plain class, so it also runs (and is tested) in-process without Ray."""

    def __init__(self, spec: RemoteDraftSpec):
        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        dtype, device = parse_dtype(spec.dtype), parse_device(spec.device)
        if spec.state_dict is not None:
            model = DecoderLM(spec.model_config)
            model.load_state_dict(spec.state_dict)
            model = model.to(device=device, dtype=dtype)
            model.init_rotary(device)  # rotary tables stay fp32, as build_model makes them
            model = model.eval().requires_grad_(False)
        else:
            from specfleet.runtime.loading import load_model

            model, _ = load_model(spec.name, dtype, device, with_tokenizer=False)
        quantize_model(model, spec.quantization)
        self.proposer = DraftModelProposer(model, spec.name, spec.config, spec.target_vocab_size, device)
        self._requests: dict[str, RequestSnapshot] = {}  # the worker's mirror of each request's tokens

    def propose(self, deltas: list[RequestDelta], num_speculative_tokens: int | None = None) -> dict[str, DraftTree]:
        if num_speculative_tokens is not None:
            self.proposer.set_num_speculative_tokens(num_speculative_tokens)
        return self.proposer.propose([self._apply(d) for d in deltas])

    def _apply(self, d: RequestDelta) -> RequestSnapshot:
        req = self._requests.get(d.request_id)
        if req is None:
            if d.start != 0 or d.params is None:
                raise RuntimeError(f"worker has no state for {d.request_id!r} but got a delta from {d.start}")
            req = self._requests[d.request_id] = RequestSnapshot(d.request_id, list(d.token_ids), d.params)
        elif d.start != req.num_tokens:
            raise RuntimeError(f"{d.request_id!r}: worker holds {req.num_tokens} tokens, delta starts at {d.start}")
        else:
            req.all_token_ids.extend(d.token_ids)  # the mirror counts every token as prompt
        return req

    def observe(self, feedback: list[Feedback]) -> None:
        self.proposer.observe(feedback)

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)
        self._requests.pop(request_id, None)

    def cache_usage(self) -> tuple[int, int]:
        """(free blocks, all blocks) of the worker's draft KV cache."""
        return self.proposer.blocks.num_free_blocks, self.proposer.blocks.num_blocks


class RemoteProposer:
    """The engine-side handle: a Proposer whose drafting runs in a Ray actor. Call it from one thread
    (the pipelined engine's drafter thread does)."""

    def __init__(self, spec: RemoteDraftSpec, actor_options: dict | None = None):
        ray = require_ray()
        self._actor = ray.remote(DraftWorker).options(**(actor_options or {})).remote(spec)
        self.name = spec.name
        self.config = spec.config
        self._length = spec.config.num_speculative_tokens  # sent with every draft call
        self._sent: dict[str, int] = {}  # tokens the worker holds, per request
        self._pending: list = []  # refs of observe/release calls, checked at the next propose

    def propose(self, requests: list[RequestView]) -> dict[str, DraftTree]:
        ray = require_ray()
        deltas = []
        for r in requests:
            have = self._sent.get(r.request_id, 0)
            tokens = r.all_token_ids
            deltas.append(RequestDelta(r.request_id, have, tokens[have:], r.params if have == 0 else None))
            self._sent[r.request_id] = len(tokens)
        trees = ray.get(self._actor.propose.remote(deltas, self._length))
        pending, self._pending = self._pending, []
        ray.get(pending)  # already run (they were submitted first); this surfaces their errors
        return trees

    @property
    def num_speculative_tokens(self) -> int:
        return self._length

    def set_num_speculative_tokens(self, n: int) -> None:
        self._length = n

    def observe(self, feedback: list[Feedback]) -> None:
        # the draft probabilities are [nodes, vocab] tensors the worker made itself: do not ship them back
        light = [dataclasses.replace(f, tree=DraftTree(f.tree.token_ids, f.tree.parents, f.tree.origins))
                 for f in feedback]
        self._pending.append(self._actor.observe.remote(light))

    def release(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._pending.append(self._actor.release.remote(request_id))

    def cache_usage(self) -> tuple[int, int]:
        ray = require_ray()
        return ray.get(self._actor.cache_usage.remote())

    def close(self) -> None:
        require_ray().kill(self._actor)


def remote_drafters(spec: RemoteDraftSpec, num_workers: int = 1,
                    actor_options: dict | None = None) -> list[RemoteProposer]:
    """`num_workers` actors with the same draft; give them to PipelinedEngine(drafters=...)."""
    return [RemoteProposer(spec, actor_options) for _ in range(num_workers)]
