"""The engine counts the draft positions the target judged: with an oracle draft that is right for the
first `right` tokens of each chain and wrong after, per-token acceptance is right / (right + 1) exactly,
while accepted / drafted also counts the tokens after the rejection the target never judged."""
from __future__ import annotations

import pytest

from specfleet.core.tree import DraftTree
from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specfleet.engine.engine import Engine
from specfleet.sampling_params import SamplingParams
from tiny_engines import engine_config, prompts_for
from tiny_models import run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class Oracle(PromptLookupProposer):
    """Drafts from the known plain output: `right` correct tokens, then `wrong` wrong ones (a chain), or
    as a tree a wrong first child beside the right chain."""

    def __init__(self, full: list[int], vocab: int, right: int, wrong: int, tree: bool = False):
        super().__init__(PromptLookupConfig(right + wrong), name="oracle")
        self.full, self.vocab, self.right, self.wrong, self.tree = full, vocab, right, wrong, tree

    def propose(self, requests):
        out = {}
        for req in requests:
            n, k = len(req.all_token_ids), self.right + self.wrong
            if n + k > len(self.full):
                continue
            good = self.full[n:n + self.right]
            bad = [(t + 1) % self.vocab for t in self.full[n + self.right:n + k]]
            chain = DraftTree.chain(good + bad, self.name)
            if self.tree:  # a wrong sibling of the first token, the right chain after it
                decoy = (self.full[n] + 2) % self.vocab
                chain = DraftTree([decoy] + chain.token_ids, [-1, -1] + [p + 1 for p in chain.parents[1:]],
                                  [self.name] * (k + 1))
            out[req.request_id] = chain
        return out


@pytest.mark.parametrize("right,wrong,tree", [(2, 2, False), (0, 3, False), (3, 0, False), (1, 2, True)])
def test_per_token_acceptance_from_an_oracle_draft(target, right, wrong, tree):
    prompt = prompts_for(1)[0]
    plain = run_to_completion(Engine(target, None, engine_config(target)), [prompt], GREEDY)[0].token_ids
    oracle = Oracle(list(prompt) + list(plain), target.config.vocab_size, right, wrong, tree)
    eng = Engine(target, None, engine_config(target), oracle)
    assert run_to_completion(eng, [prompt], GREEDY)[0].token_ids == plain
    s = eng.stats
    drafted_steps = s.drafts_used["oracle"]
    assert drafted_steps >= 3
    judged = right + (wrong > 0)  # a whole chain accepted judges no rejection
    assert s.num_accepted == right * drafted_steps
    assert s.num_judged == judged * drafted_steps
    assert s.per_token_acceptance == pytest.approx(right / judged)
    assert s.per_token_acceptance_by_position == pytest.approx([1.0] * right + [0.0] * (wrong > 0))
    assert s.acceptance_rate == pytest.approx(right / (right + wrong + tree))


def test_a_stop_inside_the_accepted_run_is_not_a_rejection(target):
    """max_tokens landing inside a run of right tokens cuts the path: the token after the cut was never
    judged, so no position loses acceptance (each max_tokens here lands somewhere in a step of 2 + 1)."""
    prompt = prompts_for(1)[0]
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = run_to_completion(Engine(target, None, engine_config(target)), [prompt], long)[0].token_ids
    for max_tokens in (20, 21, 22):
        oracle = Oracle(list(prompt) + list(plain), target.config.vocab_size, 2, 2)
        eng = Engine(target, None, engine_config(target), oracle)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert run_to_completion(eng, [prompt], params)[0].token_ids == plain[:max_tokens]
        assert eng.stats.per_token_acceptance_by_position == pytest.approx([1.0, 1.0, 0.0]), max_tokens
