"""What generation returns to callers of the offline API, the CLI and the server."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
