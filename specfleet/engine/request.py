"""A request's state: its tokens, its progress counters, its pending draft and its statistics.

Proposers see it through core.proposer.RequestView (read-only).

Progress is two counters (see ARCHITECTURE.md): `num_tokens` (prompt + output) and
`num_computed_tokens` (tokens whose KV is in the target cache). Normally the last output token is
not yet computed: it is the input of the next forward. Rollback is arithmetic on these counters
plus a truncate of the block table.
"""
from __future__ import annotations

import enum
import numbers
import time
from dataclasses import dataclass, field

from specfleet.engine.detokenize import IncrementalText
from specfleet.errors import InvalidRequestError
from specfleet.outputs import SentOutput, TokenLogprob
from specfleet.sampling_params import SamplingParams
from specfleet.core.stats import SpecStats
from specfleet.core.tree import DraftTree
from specfleet.core.verify import KeyedUniforms
from specfleet.runtime.sample.structured import Matcher
from specfleet.core.features import FeatureLog


class PromptError(InvalidRequestError):
    """A prompt the engine cannot take; `param` and `code` are the OpenAI error fields."""

    def __init__(self, message: str, param: str = "prompt", code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """The engine's admission rules for a prompt (the server checks them before a response starts)."""
    n = len(prompt_token_ids)
    if n == 0:
        raise PromptError("the prompt is empty; give at least one token")
    if n >= max_model_len:
        raise PromptError(f"the prompt has {n} tokens but the context holds {max_model_len}; "
                          f"shorten the prompt (nothing is truncated silently)", code="context_length_exceeded")
    not_ids = [t for t in prompt_token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
    if not_ids:
        raise PromptError(f"prompt token ids must be integers, got {not_ids[:5]!r}")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise PromptError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # the target's uniforms, keyed by output position (core/verify.py KeyedUniforms); None when greedy
    uniforms: KeyedUniforms | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    # origin of each output token: "target" (sampled or corrected by the target) or a proposer name
    output_origins: list[str] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    draft: DraftTree | None = None  # proposed for the next verification, if any
    output_text: str = ""
    stop_reason: str | int | None = None  # the stop string or token that ended it
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    speculate: bool = True  # False once a proposer failed on it: plain decoding from then on
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at (first) admission
    # chained hashes of the full blocks of all_token_ids, memoised for the prefix cache (block_manager.py)
    block_hashes: list[bytes] = field(default_factory=list, repr=False, compare=False)
    detokenized: IncrementalText | None = None  # the output's text so far (the StopChecker's)
    stats: SpecStats = field(default_factory=SpecStats)
    # filled only when params.logprobs / params.prompt_logprobs ask for them (engine/executor.py)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    grammar: Matcher | None = None  # params.structured_outputs' state, fed the committed tokens (executor)
    # the target's hidden features of the committed tokens, when the proposer reads them (core/features.py)
    target_features: FeatureLog | None = None
    _all_token_ids: list[int] = field(default_factory=list, repr=False, compare=False)
    # a streamed request (the async engine's): each step's output is what it added (OutputDelta), and
    # these count what was sent so far
    emit_deltas: bool = False
    sent: SentOutput = field(default_factory=SentOutput, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token: nothing predicts it

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output, kept as one list that grows with the output (read it, do not mutate it)."""
        if len(self._all_token_ids) != len(self.prompt_token_ids) + len(self.output_token_ids):
            self._all_token_ids = self.prompt_token_ids + self.output_token_ids  # first use, or a rebuild
        return self._all_token_ids

    def append_output(self, token: int, origin: str) -> None:
        self.output_token_ids.append(token)
        self.output_origins.append(origin)
        if len(self._all_token_ids) == self.num_tokens - 1:
            self._all_token_ids.append(token)

    @property
    def uses_prefix_cache(self) -> bool:
        """Prompt log-probabilities need every prompt row computed, so such a request maps no cached prefix."""
        return self.params.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_draft_tokens(self) -> int:
        return 0 if self.draft is None else len(self.draft)
