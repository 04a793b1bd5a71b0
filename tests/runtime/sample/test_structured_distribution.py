"""Constrained speculative sampling follows the *masked* target distribution (the chi-square harness of
tests/engine/test_distribution.py: the exact joint of the first three tokens, p > 0.001).

The tiny vocabulary-8 target of tests/engine/test_distribution.py, with a grammar over its tokens (spelled `a`..`g`,
token 7 the end): a first token of 5, a second that depends on the first (forced to `c` after `a`), a
third that depends on both. The exact joint masks the reference model's logits by the same rules before
`target_probs`. Drafts that know nothing of the grammar (a sampled draft-model chain, a best-first tree,
prompt lookup) propose forbidden tokens too, so the mask's effect on acceptance, rejection and the
residual is exercised; prompt lookup runs behind the grammar front (the grammar draft drafts the forced
`c`; the lookup's trees are cut where the grammar forbids).

Control: a verifier that masks every row with the grammar state of the committed tokens (the root's),
not the state after each row's own path, must be rejected by the same statistic.
"""
import itertools

import numpy as np
import pytest
import torch

from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.drafting.forced_tokens import ForcedTokensProposer
from specfleet.engine.engine import Engine
from specfleet.runtime.sample import structured as grammar_module
from specfleet.runtime.sample.structured import GrammarCompiler
from specfleet.runtime.sample.sampling import target_probs
from specfleet.sampling_params import SamplingParams, StructuredOutputsParams
from specfleet.strategies.structured_front import GrammarFront
from tests.engine.test_distribution import ALPHA, MAX_TOKENS, PARAMS, VOCAB, make_proposer, one_thread, p_values, setup  # noqa: F401

NUM_REQUESTS = 1200
EOS = 7
LETTERS = "abcdefg"


class TinyTokenizer:
    """llguidance's TokenizerWrapper fields for the 8-token vocabulary: one letter per token, then EOS."""

    tokens = [c.encode() for c in LETTERS] + [b"<eos>"]
    eos_token_id = EOS
    bos_token_id = None
    special_token_ids = [EOS]

    def __call__(self, text):
        data = text.encode() if isinstance(text, str) else text
        return [LETTERS.index(chr(c)) for c in data if chr(c) in LETTERS]


def allowed_first() -> set[int]:
    return {0, 1, 3, 4, 6}


def allowed_second(a: int) -> set[int]:
    return {2} if a == 0 else {x for x in range(7) if (x + a) % 3 != 0}


def allowed_third(a: int, b: int) -> set[int]:
    return {x for x in range(7) if (x + b) % 2 == 0 or x == a}


def language() -> list[tuple[int, int, int]]:
    return [(a, b, c) for a in allowed_first() for b in allowed_second(a) for c in allowed_third(a, b)]


def regex() -> str:
    return "(" + "|".join("".join(LETTERS[t] for t in s) for s in language()) + ")"


def mask(logits: torch.Tensor, allowed: set[int]) -> torch.Tensor:
    out = torch.full_like(logits, float("-inf"))
    idx = sorted(allowed)
    out[..., idx] = logits[..., idx]
    return out


def exact_joint_masked(hf, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """[V, V, V]: P(t1, t2, t3) under the grammar, from the reference model's logits."""
    seqs = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    with torch.no_grad():
        logits = hf(seqs).logits.float()
    joint = np.zeros((VOCAB, VOCAB, VOCAB))
    p1 = target_probs(mask(logits[:1, -3], allowed_first()), params)[0].double()
    for a in allowed_first():
        p2 = target_probs(mask(logits[a * VOCAB:a * VOCAB + 1, -2], allowed_second(a)), params)[0].double()
        for b in allowed_second(a):
            p3 = target_probs(mask(logits[a * VOCAB + b:a * VOCAB + b + 1, -1], allowed_third(a, b)),
                              params)[0].double()
            joint[a, b] = (p1[a] * p2[b] * p3).numpy()
    return joint / joint.sum()


def compiler() -> GrammarCompiler:
    return GrammarCompiler(TinyTokenizer(), VOCAB, [EOS])


def generate(target, proposer, prompt, params: dict, n: int, seed0: int):
    eng = Engine(target, None, EngineConfig(CacheConfig(block_size=4, kv_cache_bytes=8 << 20),
                                            SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=1 << 16,
                                                            max_num_prefills=n)),
                 proposer=proposer)
    eng.grammars = compiler()  # the engine has no tokenizer here: its grammar engine is handed in
    spec = StructuredOutputsParams(regex=regex())
    reqs = [eng.add_request(prompt, SamplingParams(seed=seed0 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                   structured_outputs=spec, **params)) for i in range(n)]
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    return np.array([final[r.request_id] for r in reqs]), eng.stats


def make(kind: str, draft):
    if kind == "lookup+grammar":
        shared = compiler()
        return GrammarFront(ForcedTokensProposer(lambda: shared), make_proposer("lookup", draft))
    return make_proposer(kind, draft)


def test_language_and_tiny_tokenizer_agree():
    m = compiler().matcher(StructuredOutputsParams(regex=regex()))
    assert set(torch.nonzero(m.allowed()).flatten().tolist()) == allowed_first()
    m.advance([0])
    assert m.forced_tokens(4) == [2]  # `c` is forced after `a`
    m.advance([2])
    assert set(torch.nonzero(m.allowed()).flatten().tolist()) == allowed_third(0, 2)
    m.advance([4])
    assert torch.nonzero(m.allowed()).flatten().tolist() == [EOS]  # complete: only the end


@pytest.mark.parametrize("kind,setting,seed0", [("chain", "t1", 21_000_000), ("chain", "t0.7-k3", 22_000_000),
                                                ("tree", "t1.3-p0.8", 23_000_000),
                                                ("lookup+grammar", "t1", 24_000_000)])
def test_constrained_speculative_sampling_matches_masked_target(setup, kind, setting, seed0):  # noqa: F811
    hf, target, draft, prompt = setup
    joint = exact_joint_masked(hf, prompt, SamplingParams(**PARAMS[setting]))
    samples, stats = generate(target, make(kind, draft), prompt, PARAMS[setting], NUM_REQUESTS, seed0)
    assert all(tuple(s) in set(language()) for s in samples)
    assert stats.num_drafted > NUM_REQUESTS // 4
    assert 0.0 < stats.acceptance_rate < 1.0, stats.as_dict()
    p12, p123 = p_values(samples, joint)
    print(f"{kind}/{setting}: acceptance {stats.acceptance_rate:.3f}, p(t1,t2) = {p12:.4g}, p(t1,t2,t3) = {p123:.4g}")
    assert p12 > ALPHA and p123 > ALPHA, (p12, p123)


def root_state_only(self, tree, rows):
    """Wrong: masks every row with the committed state, as if the path's tokens did not move the grammar."""
    allowed = self.allowed()
    return rows.masked_fill(~allowed, float("-inf"))


def test_control_masking_rows_without_their_paths_is_caught(setup, monkeypatch):  # noqa: F811
    hf, target, draft, prompt = setup
    joint = exact_joint_masked(hf, prompt, SamplingParams(**PARAMS["t1"]))
    monkeypatch.setattr(grammar_module.Matcher, "mask_rows", root_state_only)
    samples, _ = generate(target, make("chain", draft), prompt, PARAMS["t1"], NUM_REQUESTS, 25_000_000)
    p12, p123 = p_values(samples, joint)
    print(f"control: p(t1,t2) = {p12:.4g}, p(t1,t2,t3) = {p123:.4g}")
    assert min(p12, p123) < ALPHA


def test_exact_joint_is_a_distribution_over_the_language(setup):  # noqa: F811
    hf, _, _, prompt = setup
    joint = exact_joint_masked(hf, prompt, SamplingParams(**PARAMS["t1"]))
    support = {tuple(int(i) for i in idx) for idx in zip(*np.nonzero(joint))}
    assert support <= set(language()) and abs(joint.sum() - 1) < 1e-9
    assert len(list(itertools.islice(support, 3))) == 3
