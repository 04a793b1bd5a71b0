"""`MODEL@N`: a model named by registered name, folder or file, optionally cut to its first N layers.

Parsed here once; the loader, the draft factory, cross-vocabulary drafting, distillation and the
benchmarks all take a ModelRef. The cut keeps the final norm and the head, so `qwen-0.5b@12` still
speaks its model's vocabulary (a cheap derived draft).
"""
from __future__ import annotations

from dataclasses import dataclass

from specfleet.errors import InvalidRequestError


@dataclass(frozen=True)
class ModelRef:
    name: str  # registered name, checkpoint folder or GGUF file
    num_layers: int | None = None  # keep only the first N transformer layers

    @classmethod
    def parse(cls, text: "str | ModelRef") -> "ModelRef":
        if isinstance(text, ModelRef):
            return text
        if "@" not in text:
            return cls(text)
        name, _, n = text.rpartition("@")
        if not n.isdigit() or int(n) < 1:
            raise InvalidRequestError(f"in 'MODEL@N', N must be a positive layer count, got {n!r}")
        return cls(name, int(n))

    def __str__(self) -> str:
        return self.name if self.num_layers is None else f"{self.name}@{self.num_layers}"
