"""Engine configuration: small frozen dataclasses; `validate()` raises a ValueError naming the field."""
from __future__ import annotations

from dataclasses import dataclass, field

from specfleet.errors import InvalidRequestError


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # memory for the target's KV cache; drafts get their own budget
    # keep full blocks of computed tokens after their request ends and map them into later requests that
    # start with the same tokens (runtime/kv/blocks.py): a chat's next turn prefills only what is new
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        if self.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes < 1:
            raise InvalidRequestError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # requests running at once
    # tokens in one forward: decode rows and draft nodes first, prompt chunks in the rest (engine/scheduler.py);
    # 512 keeps prompt chunks large enough for efficient matmuls and a step short enough that decoding
    # requests keep streaming while a long prompt is prefilled
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_prefills: int = 4  # prompts prefilled side by side, sharing what decode rows leave of the budget
    # while other requests decode or wait, a step that carries prompt chunks is kept to about this many
    # decode steps' time (measured as the engine runs, engine/step_costs.py), so a long prompt slows them
    # by about this factor instead of stalling them; None: only the token budget bounds a step
    mixed_step_factor: float | None = 2.0

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidRequestError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise InvalidRequestError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_prefills < 1:
            raise InvalidRequestError(f"max_num_prefills must be >= 1, got {self.max_num_prefills}")
        if self.mixed_step_factor is not None and not self.mixed_step_factor > 1.0:
            raise InvalidRequestError(f"mixed_step_factor must be > 1 (or None), got {self.mixed_step_factor}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> None:
        self.cache.validate()
        self.scheduler.validate()
