"""Sampled outputs of the staged and vote proposers follow the target's distribution (the chi-square
harness of tests/engine/test_distribution.py: exact joint of the first three tokens, p > 0.001)."""
import copy

import pytest
import torch

from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.drafting.ngram_model import NgramModel
from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specfleet.drafting.staged import StagedConfig, StagedProposer
from specfleet.strategies.vote import VoteConfig, VoteProposer
from specfleet.sampling_params import SamplingParams
from tests.engine.test_distribution import ALPHA, PARAMS, exact_joint, generate, one_thread, p_values, setup  # noqa: F401

NUM_REQUESTS = 1200


class CountingStaged(StagedProposer):
    """Tallies chain origins, to show both stages of verification were exercised."""

    origin_counts: dict

    def propose(self, requests):
        trees = super().propose(requests)
        for t in trees.values():
            for o in t.origins:
                self.origin_counts[o] = self.origin_counts.get(o, 0) + 1
        return trees


def make(kind, draft, sampled="heaviest"):
    kv = 8 << 20
    if kind == "staged":
        p = CountingStaged(DraftModelProposer(draft, "draft", DraftModelConfig(2, kv_cache_bytes=kv)), NgramModel(),
                           StagedConfig(ngram_width=2, min_prob=0.0))
        p.origin_counts = {}
        return p
    other = copy.deepcopy(draft)  # a second, differently perturbed voter
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for w in other.parameters():
            w.add_(torch.randn(w.shape, generator=g) * 0.05)
    return VoteProposer([DraftModelProposer(draft, "a", DraftModelConfig(2, kv_cache_bytes=kv)),
                         DraftModelProposer(other, "b", DraftModelConfig(2, kv_cache_bytes=kv)),
                         PromptLookupProposer(PromptLookupConfig(2))],
                        # thresholds that punish every winner, so the lead passes between voters
                        VoteConfig(sampled=sampled, reward_threshold=0.95, punish_threshold=0.9))


@pytest.mark.parametrize("kind,setting,seed0", [("staged", "t1", 7_000_000), ("staged", "t0.7-k3", 8_000_000),
                                                ("vote-heaviest", "t1", 9_000_000), ("vote-vote", "t1", 6_000_000)])
def test_strategy_output_distribution_matches_target(setup, kind, setting, seed0):  # noqa: F811
    hf, target, draft, prompt = setup
    joint = exact_joint(hf, prompt, SamplingParams(**PARAMS[setting]))
    kind, _, mode = kind.partition("-")  # vote-MODE: the vote's `sampled` mode
    proposer = make(kind, draft, mode or "heaviest")
    samples, stats = generate(target, proposer, prompt, PARAMS[setting], NUM_REQUESTS, seed0)
    assert stats.num_drafted > NUM_REQUESTS // 4
    assert 0.0 < stats.acceptance_rate < 1.0, stats.as_dict()
    if kind == "staged":  # the draft both accepted and replaced n-gram guesses
        assert proposer.origin_counts.get("ngram", 0) > 0 and proposer.origin_counts.get("draft", 0) > 0
    else:  # the weights moved, and the winner was not always the same voter
        assert sum(w > 0 for w in proposer.wins) >= 2 and len(set(proposer.weights.values())) > 1, proposer.wins
    p12, p123 = p_values(samples, joint)
    print(f"{kind}/{setting}: acceptance {stats.acceptance_rate:.3f}, p(t1,t2) = {p12:.4g}, p(t1,t2,t3) = {p123:.4g}")
    assert p12 > ALPHA and p123 > ALPHA
