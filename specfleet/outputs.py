"""What generation returns to callers of the offline API, the CLI and the server."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target, and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first; len = the n asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    token_origins: list[str]  # per output token: "target" or the proposer that drafted it
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    metrics: dict = field(default_factory=dict)
    # with SamplingParams.logprobs: one entry per output token; with prompt_logprobs: one per prompt
    # token, None for the first (nothing predicts it)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class OutputDelta:
    """What one step added to a request's output: the text as "keep `text_keep` characters of what was
    sent, then append `text`" (stop strings and completed UTF-8 characters can change its tail), the new
    tokens, origins and log-probabilities. The executor makes these for streamed requests
    (engine/executor.py), the async engine's streams reassemble them (engine/async_engine.py)."""

    request_id: str
    text_keep: int  # characters of the text sent so far that stay
    text: str  # appended after them
    token_ids: list[int]
    token_origins: list[str]
    logprobs: list[TokenLogprob] | None  # entries for the new tokens (None when not asked for)
    prompt_logprobs: list[TokenLogprob | None] | None  # the whole list, when it changed; else None
    finished: bool
    finish_reason: str | None
    metrics: dict

    def merge(self, later: "OutputDelta") -> None:
        """Fold a later delta into this one (a full buffer keeps its length this way)."""
        if later.text_keep <= self.text_keep:
            self.text_keep, self.text = later.text_keep, later.text
        else:
            self.text = self.text[:later.text_keep - self.text_keep] + later.text
        self.token_ids = self.token_ids + later.token_ids
        self.token_origins = self.token_origins + later.token_origins
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished, self.finish_reason, self.metrics = later.finished, later.finish_reason, later.metrics


@dataclass
class SentOutput:
    """What was already sent of one streamed request's output; `delta` makes the next OutputDelta against it.
    The executor keeps one per streamed request (Request.sent) and the async engine one per cumulative
    output it diffs, so both make their deltas the one way."""

    text: str = ""
    num_tokens: int = 0
    num_logprobs: int = 0
    num_prompt_logprobs: int = 0

    def delta(self, request_id: str, text: str, token_ids: list[int], token_origins: list[str],
              logprobs: list[TokenLogprob] | None, prompt_logprobs: list[TokenLogprob | None] | None,
              finished: bool, finish_reason: str | None, metrics: dict) -> OutputDelta:
        """The part of a request's output (its whole text, tokens, origins and log-probabilities so far) not yet
        sent, as a delta; from now on it counts as sent. O(new tokens) list work."""
        keep = len(self.text) if text.startswith(self.text) else common_prefix_len(self.text, text)
        new_logprobs = None
        if logprobs is not None:
            new_logprobs = logprobs[self.num_logprobs:]
            self.num_logprobs = len(logprobs)
        new_prompt_logprobs = None
        if prompt_logprobs is not None and len(prompt_logprobs) != self.num_prompt_logprobs:
            new_prompt_logprobs = list(prompt_logprobs)  # only while a prompt's chunks are computed
            self.num_prompt_logprobs = len(prompt_logprobs)
        n = self.num_tokens
        out = OutputDelta(request_id, keep, text[keep:], token_ids[n:], token_origins[n:], new_logprobs,
                          new_prompt_logprobs, finished, finish_reason, metrics)
        self.text, self.num_tokens = text, len(token_ids)
        return out


def common_prefix_len(a: str, b: str) -> int:
    """len of the longest common prefix; fast when they differ only near the end (a text's tail changes)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    step, ok = 1, n
    while True:  # back off in doubling steps until a prefix matches, then bisect
        lo = max(0, n - step)
        if a[:lo] == b[:lo]:
            break
        ok, step = lo, step * 2
    hi = ok  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
