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

from specfleet.core.features import FeatureLog
from specfleet.core.proposer import Feedback
from specfleet.core.stats import SpecStats
from specfleet.core.tree import DraftTree
from specfleet.core.verify import VerifyResult, verify_greedy, verify_sampled
from specfleet.engine.request import Request
from specfleet.engine.scheduler import ScheduledRequest, SchedulerOutput
from specfleet.engine.step_costs import StepCostModel
from specfleet.engine.stop import StopChecker
from specfleet.outputs import OutputDelta, RequestOutput, TokenLogprob
from specfleet.runtime.kv.blocks import BlockManager
from specfleet.runtime.step.runner import ForwardItem, ModelRunner, tree_item
from specfleet.runtime.sample.sampling import target_probs

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
        items, prompt_rows = [], []
        for s in sched.scheduled:
            item, n_prompt_rows = self._forward_item(s)
            items.append(item)
            prompt_rows.append(n_prompt_rows)
        # prompt chunks and recomputation (read before committing, which moves the counters)
        num_prompt_rows = sum(s.num_new_tokens for s in sched.scheduled
                              if s.num_new_tokens > 1 or not s.completes_sequence)
        captures = self.runner.graph_captures
        t0 = time.perf_counter()
        logits = self.runner.execute(items)  # [rows, vocab]
        hidden = self.runner.last_hidden  # every row's final hidden state, when a proposer reads them
        offsets = [0]
        for it in items:
            offsets.append(offsets[-1] + len(it.token_ids))
        outputs, feedback, row = [], [], 0
        emitting = [s for s in sched.scheduled if s.completes_sequence]
        # every greedy request's argmax in one host transfer per step (not one per request)
        argmax = logits.argmax(-1).tolist() if any(
            s.request.params.is_greedy and s.request.grammar is None for s in emitting) else None
        for i, (s, n_prompt_rows) in enumerate(zip(sched.scheduled, prompt_rows)):
            start = s.request.num_computed_tokens
            if n_prompt_rows:
                self._record_prompt_logprobs(s.request, logits[row:row + n_prompt_rows])
                row += n_prompt_rows
            if not s.completes_sequence:  # a prompt chunk that stops short of the end: nothing to emit
                if hidden is not None:
                    _put_features(s.request, start, hidden[offsets[i]:offsets[i + 1]])
                s.request.num_computed_tokens += s.num_new_tokens
                self._register(s.request)
                continue
            tree = s.request.draft if s.with_draft else EMPTY_TREE
            s.request.draft = None  # a draft is verified once; the next step gets a fresh one
            rows = logits[row:row + len(tree) + 1]
            result = self._verify(s.request, tree, rows,
                                  None if argmax is None else argmax[row:row + len(tree) + 1])
            row += len(tree) + 1
            num_before = len(s.request.output_token_ids)
            fb = self._commit(s, tree, result)
            if hidden is not None:  # the verified prefix's rows, then the accepted nodes' rows
                n = s.num_new_tokens
                keep = list(range(n)) + [n + j for j in result.accepted_nodes]
                _put_features(s.request, start, hidden[offsets[i]:offsets[i + 1]][keep])
            if s.request.params.logprobs is not None:
                self._record_logprobs(s.request, rows, result.accepted_nodes,
                                      len(s.request.output_token_ids) - num_before)
            if s.with_draft:
                feedback.append(fb)
            outputs.append(self.delta(s.request) if s.request.emit_deltas else self.output(s.request))
        verify_time = time.perf_counter() - t0
        if self.runner.graph_captures != captures:  # a one-off: this shape's graph was captured (three forwards)
            self.stats.warmup_steps += 1
        else:
            self.costs.record(sum(len(it.token_ids) for it in items), verify_time)
        share = verify_time / max(1, len(emitting))
        for s in emitting:
            s.request.stats.verify_time += share
        self.stats.verify_time += verify_time
        self.stats.prompt_rows += num_prompt_rows
        return outputs, [dataclasses.replace(f, verify_time=share) for f in feedback]

    def _forward_item(self, s: ScheduledRequest) -> tuple[ForwardItem, int]:
        """The request's forward item, and how many rows of logits it asks for first for its prompt's
        log-probabilities (0 unless params.prompt_logprobs asks for them)."""
        req = s.request
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start:start + s.num_new_tokens]
        block_ids = self.blocks.block_ids(req.request_id)
        prompt_rows = self._prompt_logit_rows(req, start, len(tokens)) if req.params.prompt_logprobs is not None \
            else []
        if not s.completes_sequence:
            return ForwardItem(req.request_id, tokens, start, prompt_rows, block_ids=block_ids), len(prompt_rows)
        item = tree_item(req.request_id, tokens, start, req.draft if s.with_draft else EMPTY_TREE, block_ids)
        if prompt_rows:
            item.logit_indices = prompt_rows + item.logit_indices
        return item, len(prompt_rows)

    @staticmethod
    def _prompt_logit_rows(req: Request, start: int, n: int) -> list[int]:
        """The rows of a chunk [start, start + n) whose logits predict prompt tokens not yet scored: row i
        (position start + i) predicts token start + i + 1. After a preemption the recomputed rows are
        already scored and are skipped; the last prompt row predicts the first output token, not a prompt one."""
        done = len(req.prompt_logprobs)  # entries so far; the first is None (Request.__post_init__)
        first, end = max(start, done - 1), min(start + n, len(req.prompt_token_ids) - 1)
        return [p - start for p in range(first, end)]

    def _record_prompt_logprobs(self, req: Request, rows: torch.Tensor) -> None:
        k = len(req.prompt_logprobs)
        targets = req.prompt_token_ids[k:k + rows.shape[0]]
        req.prompt_logprobs.extend(token_logprobs(rows, targets, req.params.prompt_logprobs))

    @staticmethod
    def _record_logprobs(req: Request, rows: torch.Tensor, path: list[int], num_emitted: int) -> None:
        """The emitted tokens' log-probabilities from the rows that verified them: the first token was
        predicted by the root's row (0), each later one by the row of the accepted node before it. These
        are the rows plain decoding would have computed, so the numbers are the same with or without a draft."""
        if num_emitted <= 0:
            return
        row_ids = [0] + [j + 1 for j in path[:num_emitted - 1]]
        tokens = req.output_token_ids[len(req.output_token_ids) - num_emitted:]
        if req.logprobs is None:
            req.logprobs = []
        req.logprobs.extend(token_logprobs(rows[row_ids], tokens, req.params.logprobs))

    @staticmethod
    def _verify(req: Request, tree: DraftTree, rows: torch.Tensor, argmax: list[int] | None) -> VerifyResult:
        """`argmax`: the rows' unmasked argmax, read for the whole step at once."""
        if req.grammar is not None:  # each row masked by the grammar after its path (runtime/sample/structured.py)
            rows, argmax = req.grammar.mask_rows(tree, rows), None
        if req.params.is_greedy:
            return verify_greedy(tree, argmax if argmax is not None else rows.argmax(-1).tolist())
        return verify_sampled(tree, target_probs(rows, req.params), req.uniforms, len(req.output_token_ids))

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
        if req.grammar is not None:
            req.grammar.advance(tokens[:num_emitted])
        if is_decode:  # the prefill's first token is not a speculation step (see core/stats.py)
            proposer = tree.origins[0] if len(tree) else None
            # a rejection was judged where the whole path was kept (no stop cut it) and the tree went on past it
            frontier = path[num_accepted - 1] if num_accepted else -1
            judged = num_accepted + (num_accepted == len(path) and frontier in tree.parents)
            req.stats.record_step(len(tree), num_accepted, num_emitted, proposer, judged)
            self.stats.record_step(len(tree), num_accepted, num_emitted, proposer, judged)
        else:
            req.stats.num_emitted += num_emitted
            self.stats.num_emitted += num_emitted
        fb = Feedback(req.request_id, tree, path[:num_accepted], num_emitted, 0.0, tokens[:num_emitted])
        self._register(req)  # after the emitted tokens joined the sequence, before a finish frees the table
        if req.finish_reason is not None:
            self.finish(req)
        return fb

    def _register(self, req: Request) -> None:
        """Offer the request's full blocks of computed (final) KV to the prefix cache."""
        self.blocks.register(req.request_id, req.all_token_ids, req.num_computed_tokens, req.block_hashes,
                             req.params.cache_salt)

    def output(self, req: Request) -> RequestOutput:
        text = self.stop_checker.text(req)
        return RequestOutput(req.request_id, None, req.prompt_token_ids, text, list(req.output_token_ids),
                             list(req.output_origins), req.is_finished, req.finish_reason, self._metrics(req),
                             None if req.logprobs is None else list(req.logprobs),
                             None if req.prompt_logprobs is None else list(req.prompt_logprobs))

    def delta(self, req: Request) -> OutputDelta:
        """What this step added to `req`'s output since the last delta: O(new tokens) list work, where a
        cumulative output copies every list of the whole output every step (O(n^2) over a request)."""
        return req.sent.delta(req.request_id, self.stop_checker.text(req), req.output_token_ids, req.output_origins,
                              req.logprobs, req.prompt_logprobs, req.is_finished, req.finish_reason,
                              self._metrics(req))

    @staticmethod
    def _metrics(req: Request) -> dict:
        metrics = req.stats.as_dict()
        metrics["num_preemptions"] = req.num_preemptions
        metrics["num_cached_tokens"] = req.num_cached_tokens
        if req.grammar is not None and req.grammar.notes:  # what of a JSON schema was not fully enforced
            metrics["structured_output"] = req.grammar.notes.as_dict()
        if req.first_token_time is not None:
            metrics["ttft_s"] = round(req.first_token_time - req.arrival_time, 6)
        if req.finish_time is not None:
            metrics["latency_s"] = round(req.finish_time - req.arrival_time, 6)
        return metrics


def _put_features(req: Request, position: int, rows: torch.Tensor) -> None:
    if req.target_features is None:
        req.target_features = FeatureLog()
    req.target_features.put(position, rows)


def token_logprobs(rows: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """Row i's log-softmax at tokens[i], with the row's `top_n` most likely tokens, most likely first."""
    lp = torch.log_softmax(rows.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if top_n:
        top = torch.topk(lp, top_n, dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_lps = [[] for _ in tokens]
    return [TokenLogprob(t, p, list(zip(ids, lps))) for t, p, ids, lps in zip(tokens, picked, top_ids, top_lps)]
