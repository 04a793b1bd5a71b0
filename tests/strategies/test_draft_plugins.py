"""The draft registry (core/proposer.py `register`) is the way in for a draft kind that lives outside the
package: a name registered there is built by the draft-spec factory like a built-in leaf, with its options."""
import torch

from specfleet.core import proposer as proposer_mod
from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specfleet.strategies.factory import SpecConfig, build_proposer


def test_a_registered_draft_is_built_by_name_with_its_options(monkeypatch):
    made = []

    def factory(num_speculative_tokens: int = 4, branches: int = 1):
        made.append((num_speculative_tokens, branches))
        return PromptLookupProposer(PromptLookupConfig(num_speculative_tokens, num_branches=branches))

    monkeypatch.setattr(proposer_mod, "_REGISTRY", {"my-lookup": factory})
    assert proposer_mod.registered_names() == ["my-lookup"]
    p = build_proposer("my-lookup[branches=2]", SpecConfig(num_speculative_tokens=3), 100, torch.float32,
                       torch.device("cpu"))
    assert isinstance(p, PromptLookupProposer)
    assert made == [(3, 2)]
