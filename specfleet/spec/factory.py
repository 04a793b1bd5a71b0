"""Building a proposer from a draft name and its settings.

A draft name is either a registered weightless or composite proposer ("prompt-lookup", ...) or a
model: a registered embedded model name or a checkpoint path, which becomes a DraftModelProposer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specfleet.spec import prompt_lookup  # noqa: F401  (registers "prompt-lookup")
from specfleet.spec.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.spec.proposer import Proposer, get_factory, registered_names

ALIASES = {"ngram": "prompt-lookup", "lookup": "prompt-lookup"}


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings shared by every draft source; fields a source does not use are ignored."""

    num_speculative_tokens: int = 4  # chain length / tree depth
    top_children: int = 1  # > 1: a best-first tree with this branching
    max_nodes: int = 16  # tree node budget
    draft_kv_cache_bytes: int = 512 << 20


def build_proposer(draft: str | None, spec: SpecConfig, target_vocab_size: int, dtype: torch.dtype,
                   device: torch.device) -> Proposer | None:
    if draft is None or draft.lower() in ("", "none"):
        return None
    name = ALIASES.get(draft, draft)
    if name in registered_names():
        kwargs = {"num_speculative_tokens": spec.num_speculative_tokens}
        if name == "prompt-lookup":
            kwargs["num_branches"] = spec.top_children
        return get_factory(name)(**kwargs)
    from specfleet.llm import load_model  # a model draft: load it like the target

    model, _ = load_model(draft, dtype, device, with_tokenizer=False)
    cfg = DraftModelConfig(spec.num_speculative_tokens, spec.top_children, spec.max_nodes, spec.draft_kv_cache_bytes)
    return DraftModelProposer(model, draft, cfg, target_vocab_size, device)
