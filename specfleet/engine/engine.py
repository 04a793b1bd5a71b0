"""The engine loop: schedule -> forward -> verify -> commit -> propose.

Plain autoregressive decoding is the degenerate case of speculation: a request without a draft is
verified against an empty tree, which samples one token from the target. There is one code path.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from specfleet.config import EngineConfig
from specfleet.engine.block_manager import BlockManager
from specfleet.engine.request import Request, RequestStatus
from specfleet.engine.scheduler import ScheduledRequest, Scheduler
from specfleet.engine.stop import StopChecker
from specfleet.errors import InvalidRequestError
from specfleet.outputs import RequestOutput
from specfleet.runtime.kv_cache import KVCache, num_blocks_for_budget
from specfleet.runtime.model import DecoderLM
from specfleet.runtime.model_runner import ForwardItem, ModelRunner
from specfleet.runtime.sampling import make_generator, target_probs
from specfleet.sampling_params import SamplingParams
from specfleet.spec.metrics import SpecStats
from specfleet.spec.proposer import Feedback, Proposer
from specfleet.spec.tree import DraftTree
from specfleet.spec.verify import VerifyResult, verify_greedy, verify_sampled

EMPTY_TREE = DraftTree()


class Engine:
    def __init__(self, model: DecoderLM, tokenizer=None, config: EngineConfig | None = None,
                 proposer: Proposer | None = None, device: torch.device | str = "cpu"):
        self.config = config or EngineConfig()
        self.config.validate()
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        mcfg = model.config
        sc = self.config.scheduler
        self.max_model_len = min(sc.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        cc = self.config.cache
        num_blocks = num_blocks_for_budget(mcfg, self.dtype, cc.kv_cache_bytes, cc.block_size)
        if num_blocks * cc.block_size < self.max_model_len + 64:
            # a lone request of full length (plus a draft tree) must always fit, or it could never finish
            self.max_model_len = num_blocks * cc.block_size - 64
            if self.max_model_len < 2:
                raise InvalidRequestError(f"kv_cache_bytes={cc.kv_cache_bytes} is too small for this model")
        self.blocks = BlockManager(num_blocks, cc.block_size)
        self.runner = ModelRunner(model, KVCache.allocate(mcfg, num_blocks, cc.block_size, self.dtype, self.device),
                                  self.device)
        self.scheduler = Scheduler(self.blocks, sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_num_prefills)
        self.proposer = proposer
        self.stop_checker = StopChecker(tokenizer, mcfg.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.stats = SpecStats()
        self._ids = itertools.count()

    # -- request lifecycle -----------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        params.validate()
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens but the context holds {self.max_model_len}; "
                f"shorten the prompt (nothing is truncated silently)")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        generator = None if params.is_greedy else make_generator(params.seed, self.device)
        req = Request(request_id, list(prompt_token_ids), params, generator)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            req.finish_reason = "abort"
            self._finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish(self, req: Request) -> None:
        req.finish_time = time.perf_counter()
        self.scheduler.finish(req)
        if self.proposer is not None:
            self.proposer.release(req.request_id)
        self.requests.pop(req.request_id, None)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if self.proposer is not None:
            for req in sched.preempted:
                self.proposer.release(req.request_id)
        if sched.is_empty:
            return []
        outputs, feedback = self._execute(sched)
        if self.proposer is not None:
            if feedback:
                self.proposer.observe(feedback)
            self._propose()
        return outputs

    def _execute(self, sched) -> tuple[list[RequestOutput], list[Feedback]]:
        """Forward, verify and commit one schedule (the middle of a step, shared with the pipelined
        engine): the outputs, and feedback for every verified draft with its share of the forward."""
        items = [self._forward_item(s) for s in sched.scheduled]
        t0 = time.perf_counter()
        logits = self.runner.execute(items, self.blocks)  # [rows, vocab]
        outputs, feedback, row = [], [], 0
        emitting = [s for s in sched.scheduled if s.completes_sequence]
        for s in sched.scheduled:
            if not s.completes_sequence:  # a prompt chunk that stops short of the end: nothing to emit
                s.request.num_computed_tokens += s.num_new_tokens
                continue
            tree = s.request.draft if s.with_draft else EMPTY_TREE
            s.request.draft = None  # a draft is verified once; the next step gets a fresh one
            rows = logits[row:row + len(tree) + 1]
            row += len(tree) + 1
            result = self._verify(s.request, tree, rows)
            fb = self._commit(s, tree, result)
            if fb is not None and s.with_draft:
                feedback.append(fb)
            outputs.append(self._output(s.request))
        verify_time = time.perf_counter() - t0
        share = verify_time / max(1, len(emitting))
        for s in emitting:
            s.request.stats.verify_time += share
        self.stats.verify_time += verify_time
        return outputs, [dataclasses.replace(f, verify_time=share) for f in feedback]

    def _forward_item(self, s: ScheduledRequest) -> ForwardItem:
        req = s.request
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start:start + s.num_new_tokens]
        if not s.completes_sequence:
            return ForwardItem(req.request_id, tokens, start, [])
        if not s.with_draft:
            return ForwardItem(req.request_id, tokens, start, [len(tokens) - 1])
        # the prefix tokens are causal; the last one is the tree's root and the tree hangs below it
        tree = req.draft
        n_prefix = len(tokens)
        n = n_prefix + len(tree)
        mask = torch.ones(n, n, dtype=torch.bool).tril_()
        tmask = tree.verify_mask()  # [tree+1, tree+1], row 0 = root
        mask[n_prefix - 1:, n_prefix - 1:] = tmask
        mask[n_prefix:, :n_prefix - 1] = True
        root_pos = start + n_prefix - 1
        positions = list(range(start, root_pos)) + tree.verify_positions(root_pos)
        return ForwardItem(req.request_id, tokens + tree.token_ids, start,
                           list(range(n_prefix - 1, n)), positions, mask)

    def _verify(self, req: Request, tree: DraftTree, rows: torch.Tensor) -> VerifyResult:
        if req.params.is_greedy:
            return verify_greedy(tree, rows.argmax(-1).tolist())  # host sync: one per request per step
        return verify_sampled(tree, target_probs(rows, req.params), req.generator)

    def _commit(self, s: ScheduledRequest, tree: DraftTree, result: VerifyResult) -> Feedback | None:
        """Append the emitted tokens (stopping where a stop condition hits), keep the accepted KV."""
        req = s.request
        # layout index of tree node j is base + j; the root sits just before base
        base = req.num_computed_tokens + s.num_new_tokens
        path = result.accepted_nodes
        if path != list(range(len(path))):
            src = torch.tensor([self.blocks.slot(req.request_id, base + j) for j in path], device=self.device)
            dst = torch.tensor([self.blocks.slot(req.request_id, base + i) for i in range(len(path))],
                               device=self.device)
            self.runner.kv.copy_slots(src, dst)
        req.num_computed_tokens = base + len(path)
        self.blocks.truncate(req.request_id, req.num_computed_tokens)
        now = time.perf_counter()
        if req.first_token_time is None:
            req.first_token_time = now
        is_decode = bool(req.output_token_ids)
        tokens = result.emitted_tokens(tree)
        origins = [tree.origins[j] for j in path] + ["target"]
        num_emitted = 0
        for tok, origin in zip(tokens, origins):
            num_emitted += 1
            if self.stop_checker.append(req, tok, origin):
                break
        num_accepted = min(len(path), num_emitted)
        if is_decode:  # the prefill's first token is not a speculation step (see spec/metrics.py)
            proposer = tree.origins[0] if len(tree) else None
            req.stats.record_step(len(tree), num_accepted, num_emitted, proposer)
            self.stats.record_step(len(tree), num_accepted, num_emitted, proposer)
        else:
            req.stats.num_emitted += num_emitted
            self.stats.num_emitted += num_emitted
        fb = Feedback(req.request_id, tree, path[:num_accepted], num_emitted, 0.0, req.all_token_ids)
        if req.finish_reason is not None:
            self._finish(req)
        return fb

    def _propose(self) -> None:
        ready = [r for r in self.scheduler.running
                 if r.status == RequestStatus.RUNNING and r.num_uncomputed == 1 and r.draft is None]
        if not ready:
            return
        t0 = time.perf_counter()
        trees = self.proposer.propose(ready)
        dt = time.perf_counter() - t0
        self.stats.draft_time += dt
        for r in ready:
            r.stats.draft_time += dt / len(ready)
            tree = trees.get(r.request_id)
            room = self.max_model_len - r.num_tokens  # never verify past the context
            if tree is not None and len(tree) and room > 0:
                r.draft = tree if len(tree) <= room else tree.truncated(room)

    def _output(self, req: Request) -> RequestOutput:
        text = self.stop_checker.text(req)
        metrics = req.stats.as_dict()
        metrics["num_preemptions"] = req.num_preemptions
        if req.first_token_time is not None:
            metrics["ttft_s"] = round(req.first_token_time - req.arrival_time, 6)
        if req.finish_time is not None:
            metrics["latency_s"] = round(req.finish_time - req.arrival_time, 6)
        return RequestOutput(req.request_id, None, req.prompt_token_ids, text, list(req.output_token_ids),
                             list(req.output_origins), req.is_finished, req.finish_reason, metrics)
