"""A request's state: its tokens, its progress counters, its pending draft and its statistics.

Progress is two counters (see ARCHITECTURE.md): `num_tokens` (prompt + output) and
`num_computed_tokens` (tokens whose KV is in the target cache). Normally the last output token is
not yet computed: it is the input of the next forward. Rollback is arithmetic on these counters
plus a truncate of the block table.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from specfleet.sampling_params import SamplingParams
from specfleet.spec.metrics import SpecStats
from specfleet.spec.tree import DraftTree


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
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
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_draft_tokens(self) -> int:
        return 0 if self.draft is None else len(self.draft)
