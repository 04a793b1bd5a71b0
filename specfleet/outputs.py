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
