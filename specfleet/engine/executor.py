"""The middle of every engine step: forward a schedule, verify each draft, commit what was kept.

Both drivers call it: the plain engine (engine.py), which then drafts for the next step itself,
and the pipelined engine (pipelined.py), whose drafter threads draft through the result pool.

Plain autoregressive decoding is the degenerate case of speculation: a request without a draft is
verified against an empty tree, which samples one token from the target. There is one code path.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from specfleet.core.proposer import Feedback
from specfleet.core.stats import SpecStats
from specfleet.core.tree import DraftTree
from specfleet.core.verify import VerifyResult, verify_greedy, verify_sampled
from specfleet.engine.request import Request
from specfleet.engine.scheduler import ScheduledRequest, SchedulerOutput
from specfleet.engine.step_costs import StepCostModel
from specfleet.engine.stop import StopChecker
from specfleet.outputs import RequestOutput
from specfleet.runtime.block_manager import BlockManager
from specfleet.runtime.model_runner import ForwardItem, ModelRunner, tree_item
from specfleet.runtime.sampling import target_probs

EMPTY_TREE = DraftTree()


class StepExecutor:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, stop_checker: StopChecker, stats: SpecStats,
                 finish: Callable[[Request], None]):
        self.runner = runner
        self.blocks = blocks
        self.stop_checker = stop_checker
        self.stats = stats  # the engine's totals
        self.finish = finish  # called for every request that finishes while committing
        self.costs = StepCostModel()  # step time against rows, for the scheduler's mixed-step cap

    def execute(self, sched: SchedulerOutput) -> tuple[list[RequestOutput], list[Feedback]]:
        """Forward, verify and commit one schedule: the outputs, and feedback for every verified
        draft with its share of the forward."""
        items = [self._forward_item(s) for s in sched.scheduled]
        t0 = time.perf_counter()
        logits = self.runner.execute(items)  # [rows, vocab]
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
            if s.with_draft:
                feedback.append(fb)
            outputs.append(self.output(s.request))
        verify_time = time.perf_counter() - t0
        self.costs.record(sum(len(it.token_ids) for it in items), verify_time)
        share = verify_time / max(1, len(emitting))
        for s in emitting:
            s.request.stats.verify_time += share
        self.stats.verify_time += verify_time
        return outputs, [dataclasses.replace(f, verify_time=share) for f in feedback]

    def _forward_item(self, s: ScheduledRequest) -> ForwardItem:
        req = s.request
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start:start + s.num_new_tokens]
        block_ids = self.blocks.block_ids(req.request_id)
        if not s.completes_sequence:
            return ForwardItem(req.request_id, tokens, start, [], block_ids=block_ids)
        return tree_item(req.request_id, tokens, start, req.draft if s.with_draft else EMPTY_TREE, block_ids)

    @staticmethod
    def _verify(req: Request, tree: DraftTree, rows: torch.Tensor) -> VerifyResult:
        if req.params.is_greedy:
            return verify_greedy(tree, rows.argmax(-1).tolist())  # host sync: one per request per step
        return verify_sampled(tree, target_probs(rows, req.params), req.generator)

    def _commit(self, s: ScheduledRequest, tree: DraftTree, result: VerifyResult) -> Feedback:
        """Append the emitted tokens (stopping where a stop condition hits), keep the accepted KV."""
        req = s.request
        base = req.num_computed_tokens + s.num_new_tokens  # layout index of tree node 0 (the root is before it)
        path = result.accepted_nodes
        self.runner.commit_path(self.blocks, req.request_id, base, path)
        req.num_computed_tokens = base + len(path)
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
        if is_decode:  # the prefill's first token is not a speculation step (see core/stats.py)
            proposer = tree.origins[0] if len(tree) else None
            req.stats.record_step(len(tree), num_accepted, num_emitted, proposer)
            self.stats.record_step(len(tree), num_accepted, num_emitted, proposer)
        else:
            req.stats.num_emitted += num_emitted
            self.stats.num_emitted += num_emitted
        fb = Feedback(req.request_id, tree, path[:num_accepted], num_emitted, 0.0, tokens[:num_emitted])
        if req.finish_reason is not None:
            self.finish(req)
        return fb

    def output(self, req: Request) -> RequestOutput:
        text = self.stop_checker.text(req)
        metrics = req.stats.as_dict()
        metrics["num_preemptions"] = req.num_preemptions
        if req.first_token_time is not None:
            metrics["ttft_s"] = round(req.first_token_time - req.arrival_time, 6)
        if req.finish_time is not None:
            metrics["latency_s"] = round(req.finish_time - req.arrival_time, 6)
        return RequestOutput(req.request_id, None, req.prompt_token_ids, text, list(req.output_token_ids),
                             list(req.output_origins), req.is_finished, req.finish_reason, metrics)
