"""The engine loop: schedule -> forward, verify, commit (executor.py) -> propose.

The engine owns the requests, the scheduler, the target's KV cache and the proposer; one step runs
the schedule through the StepExecutor and then drafts for every request that is ready.
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from specfleet.config import EngineConfig
from specfleet.core.features import reads_features
from specfleet.core.proposer import Proposer, StepTiming, observe_step
from specfleet.core.stats import SpecStats
from specfleet.engine.executor import StepExecutor
from specfleet.engine.request import Request, RequestStatus, check_prompt
from specfleet.engine.scheduler import Scheduler
from specfleet.engine.stop import StopChecker
from specfleet.errors import InvalidRequestError, SpecfleetError
from specfleet.outputs import RequestOutput
from specfleet.runtime.kv.blocks import BlockManager
from specfleet.runtime.sample.structured import GrammarCompiler, Matcher, compiler_for
from specfleet.runtime.kv.cache import KVCache, num_blocks_for_budget
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.runtime.step.runner import ForwardItem, ModelRunner
from specfleet.runtime.sample.sampling import request_uniforms
from specfleet.sampling_params import SamplingParams

logger = logging.getLogger("specfleet.engine")


STEP_FIXED_SHARES = 20  # a bounded step lasts at least this many fixed parts (decode steps): ~5 % of a prefill


class StepFailedError(SpecfleetError):
    """A step's forward, verification or commit raised: the requests in that step were aborted (their KV
    blocks freed) and the engine can go on with the others. `request_ids`: the requests it failed."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"an engine step failed on a batch of {len(request_ids)} request(s): {cause!r}")
        self.request_ids, self.cause = request_ids, cause


def is_fatal(error: BaseException) -> bool:
    """Errors after which no later step can be trusted: the process (MemoryError, KeyboardInterrupt) or
    the device (a CUDA error poisons the context for good)."""
    return not isinstance(error, Exception) or isinstance(error, MemoryError) \
        or type(error).__name__ == "AcceleratorError" or "CUDA error" in str(error)


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
        self.blocks = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.runner = ModelRunner(model, KVCache.allocate(mcfg, num_blocks, cc.block_size, self.dtype, self.device),
                                  self.device)
        self.scheduler = Scheduler(self.blocks, sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_num_prefills)
        self.proposer = proposer
        self.stop_checker = StopChecker(tokenizer, mcfg.eos_token_ids, self.max_model_len)
        # about how long one step may take (engine/step_costs.py rows_within), so a request arriving during a
        # long prefill waits little for the step in flight; None (offline use): steps take the whole budget.
        # The server sets it (AsyncEngine)
        self.max_step_s: float | None = None
        self.requests: dict[str, Request] = {}
        self.stats = SpecStats()
        # the engine's clock for the proposers (core/proposer.StepTiming): when the last drafting ended, how long
        # it took, and the target's forward seconds counted by then
        self._drafted_at: float | None = None
        self._draft_s = 0.0
        self._verify_at = 0.0
        self._prompt_rows_at = self._warmups_at = 0
        self.executor = StepExecutor(self.runner, self.blocks, self.stop_checker, self.stats, self._finish)
        self.runner.keep_hidden = reads_features(proposer)  # a draft head reads the target's features
        self._ids = itertools.count()
        self.grammars: GrammarCompiler | None = None  # built on the first constrained request (grammar_compiler)

    def capture_graphs(self, max_new: int = 8) -> int:
        """With CUDA graphs (RuntimeConfig.cuda_graphs on a GPU), capture now, before any request, the step shapes
        of up to max_num_seqs requests and `max_new` new tokens each (runtime/backends/cuda/graphs.py,
        StepGraphs.ahead), each on a step of scratch requests whose cache blocks are freed after, so no request's
        step pays a capture. Returns the number of shapes made; 0 where the runner has no graphs."""
        if not self.runner.pads_ragged:
            return 0
        if self.requests:
            raise RuntimeError("capture_graphs runs before any request is added")
        from specfleet.runtime.backends.cuda.graphs import StepGraphs

        if self.runner.graphs is None:
            self.runner.graphs = StepGraphs(self.runner)
        graphs, before = self.runner.graphs, len(self.runner.graphs._shapes)
        for b, n in StepGraphs.ahead(self.config.scheduler.max_num_seqs, max_new):
            if not self.blocks.can_allocate(b * n + b * self.blocks.block_size):
                break
            rids = [f"__graphs_{b}_{n}_{i}__" for i in range(b)]
            for rid in rids:
                self.blocks.allocate(rid, n)
            try:
                items = [ForwardItem(rid, [0] * n, 0, list(range(n))) for rid in rids]
                if graphs.shape_of(items) is not None:
                    self.runner.execute(items, self.blocks)
            finally:
                for rid in rids:
                    self.blocks.free(rid)
        return len(graphs._shapes) - before

    # -- request lifecycle -----------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, compiled: bool = False) -> None:
        """Raise InvalidRequestError unless `add_request` takes this prompt with these params; a batch is
        checked whole with it before any of it is queued (LLM.generate). `compiled`: the caller already
        checked the grammar (and built its matcher)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        check_prompt(prompt_token_ids, self.model.config.vocab_size, self.max_model_len)
        if params.structured_outputs is not None and not compiled:
            self.grammar_compiler().grammar(params.structured_outputs)  # an invalid grammar is the request's error

    def grammar_compiler(self) -> GrammarCompiler:
        """The grammar engine for this model's tokenizer (runtime/sample/structured.py), built on first use."""
        if self.grammars is None:
            self.grammars = compiler_for(self.tokenizer, self.model.config.vocab_size,
                                         sorted(self.stop_checker.eos_token_ids))
        return self.grammars

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, grammar: Matcher | None = None) -> Request:
        """Queue a request. `grammar`: its matcher, built by the caller from params.structured_outputs
        (`grammar_compiler().matcher`) on another thread, so that compiling a large grammar does not hold
        up the thread that steps the engine (the server does this); None builds it here."""
        if grammar is not None and params.structured_outputs is None:
            raise InvalidRequestError("a grammar matcher was given for a request without structured_outputs")
        self.check_request(prompt_token_ids, params, compiled=grammar is not None)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        uniforms = None if params.is_greedy else request_uniforms(params.seed)
        req = Request(request_id, list(prompt_token_ids), params, uniforms)
        if params.structured_outputs is not None:
            req.grammar = grammar if grammar is not None else self.grammar_compiler().matcher(params.structured_outputs)
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
        self._release_draft(req.request_id)
        self.requests.pop(req.request_id, None)

    def _release_draft(self, request_id: str) -> None:
        """The request finished or was preempted: its draft state goes."""
        if self.proposer is not None:
            try:
                self.proposer.release(request_id)
            except Exception as e:  # noqa: BLE001 - counted; the request finishes all the same
                self._draft_failed([], "release", e)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._set_row_cap()
        sched = self.scheduler.schedule()
        for req in sched.preempted:
            self._release_draft(req.request_id)
        if sched.is_empty:
            return []
        try:
            outputs, feedback = self.executor.execute(sched)
        except BaseException as e:  # noqa: BLE001 - one batch's failure is its own (StepFailedError)
            if is_fatal(e):
                raise
            raise self._step_failed(sched, e) from e
        if self.proposer is not None:
            if feedback:
                self._observe(feedback)
            self._propose()
        return outputs

    def _step_failed(self, sched, error: Exception) -> StepFailedError:
        """Abort every request of the failed step: their state (counters, blocks, drafts) may be half
        updated, and freeing them whole leaves the scheduler and the block manager consistent."""
        ids = [s.request.request_id for s in sched.scheduled]
        for request_id in ids:
            self.abort(request_id)  # a no-op for one that finished in the step before the failure
        return StepFailedError(ids, error)

    def _observe(self, feedback: list) -> None:
        try:
            self.proposer.observe(feedback)
        except Exception as e:  # noqa: BLE001 - a draft source's bug must not stop the engine (_draft_failed)
            self._draft_failed([r for fb in feedback if (r := self.requests.get(fb.request_id)) is not None],
                               "observe", e)

    def _draft_failed(self, requests: list[Request], call: str, error: Exception) -> None:
        """A proposer call raised: the requests it was for go on by plain decoding, which verification
        makes give the same output as speculation, and their draft state is dropped. Drafts are an
        optimisation, so one broken draft source must not end the other requests or the engine. Each
        failure is counted in `stats.num_draft_failures`; the first is logged with its traceback."""
        self.stats.num_draft_failures += 1
        for r in requests:
            r.stats.num_draft_failures += 1  # in its response's `spec` block
            self.stats.num_draft_fallbacks += r.speculate
        if self.stats.num_draft_failures == 1:
            logger.error("proposer.%s raised; its %d request(s) continue without speculation (later failures "
                         "are only counted, in stats.num_draft_failures)", call, len(requests), exc_info=error)
        for r in requests:
            r.speculate = False
            r.draft = None
            self._release_draft(r.request_id)

    def _set_row_cap(self) -> None:
        costs = self.executor.costs
        factor = self.config.scheduler.mixed_step_factor
        self.scheduler.row_cap = None if factor is None else costs.row_cap(factor)
        if self.max_step_s is None:
            self.scheduler.step_cap = None
        else:  # never below STEP_FIXED_SHARES fixed parts, so bounded steps cost a prefill only a few %
            fixed = costs.fixed_s
            self.scheduler.step_cap = costs.rows_within(max(self.max_step_s, STEP_FIXED_SHARES * (fixed or 0.0)))

    @property
    def draft_source(self) -> Proposer | None:
        """The proposer behind this engine's drafts, for introspection (metrics, strategy state)."""
        return self.proposer

    def _propose(self) -> None:
        ready = [r for r in self.scheduler.running
                 if r.status == RequestStatus.RUNNING and r.num_uncomputed == 1 and r.draft is None and r.speculate]
        if not ready:
            return
        t0 = time.perf_counter()
        try:
            if self._drafted_at is not None:  # the engine's clock, handed to the strategies that adapt to time
                observe_step(self.proposer, StepTiming(t0 - self._drafted_at, self._draft_s,
                                                       self.stats.verify_time - self._verify_at, len(ready),
                                                       self.stats.prompt_rows - self._prompt_rows_at,
                                                       self.stats.warmup_steps - self._warmups_at,
                                                       self.runner.pads_ragged))
            trees = self.proposer.propose(ready)
        except Exception as e:  # noqa: BLE001 - see _draft_failed
            self._draft_failed(ready, "propose", e)
            return
        finally:
            now = time.perf_counter()
            self._drafted_at, self._draft_s, self._verify_at = now, now - t0, self.stats.verify_time
            self._prompt_rows_at, self._warmups_at = self.stats.prompt_rows, self.stats.warmup_steps
        dt = self._draft_s
        self.stats.draft_time += dt
        for r in ready:
            r.stats.draft_time += dt / len(ready)
            tree = trees.get(r.request_id)
            room = self.max_model_len - r.num_tokens  # never verify past the context
            if tree is not None and len(tree) and room > 0:
                r.draft = tree if len(tree) <= room else tree.truncated(room)
