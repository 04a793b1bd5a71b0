"""Speculative sampling is lossless: the engine's output distribution is the target's, statistically.

A tiny random target with a vocabulary of 8 and a perturbed copy of it as the draft (so acceptance
is partial). Many seeded requests of 3 tokens run in one batched engine run per setting. The first
token of a request is sampled by the plain (prefill) step; the proposer drafts from then on, so
tokens 2 and 3 are the first and second *speculated* tokens (token 3 is either an accepted draft
token, a bonus token, or the result of a second verification after a rejection). We compare the
empirical joint distribution of (token 1, token 2) and of (token 1, token 2, token 3) with the exact
joint computed from the transformers reference model's own logits through `target_probs`, by
Pearson's chi-square test with low-expectation cells merged, and require p > 0.001.

Then the same statistic must reject (p < 0.001) when the engine's verifier is swapped for a
deliberately wrong one: that shows the test has the power to catch a lossy verifier.

Everything is seeded, so the test is deterministic.
"""
import copy

import numpy as np
import pytest
import scipy.stats
import torch

import specfleet.engine.executor as engine_module
from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.engine.engine import Engine
from specfleet.runtime.sample.sampling import target_probs
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.draft_model import DraftModelConfig, DraftModelProposer
from specfleet.drafting.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specfleet.core.tree import DraftTree
from specfleet.core.verify import VerifyResult, draw_at
from tiny_models import ours_from_hf, tiny_hf_model

VOCAB = 8
# requests per setting: the tree drafts request by request, so it gets fewer (it is the slowest)
NUM_REQUESTS = {"chain": 1500, "tree": 1000, "lookup": 1500}
MAX_TOKENS = 3
MIN_EXPECTED = 5.0  # cells expected to hold fewer samples are merged
ALPHA = 1e-3

PARAMS = {
    "t1": dict(temperature=1.0),
    "t0.7-k3": dict(temperature=0.7, top_k=3),
    "t1.3-p0.8": dict(temperature=1.3, top_p=0.8),
}
PROPOSERS = ["chain", "tree", "lookup"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny per-request ops: extra threads only add contention on a shared machine
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def setup():
    hf = tiny_hf_model("qwen2", seed=0, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # random init gives near-uniform rows; sharpen them
    target = ours_from_hf(hf)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    # a prompt that repeats its own greedy continuation, so prompt lookup finds n-gram matches
    seq = [1, 4]
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    prompt = seq + seq[:3]
    return hf, target, draft, prompt


def make_proposer(kind: str, draft):
    if kind == "chain":  # sampled chain: draft_probs are recorded and used by verification
        return DraftModelProposer(draft, "draft", DraftModelConfig(num_speculative_tokens=2, kv_cache_bytes=8 << 20))
    if kind == "tree":  # best-first tree, deterministic children: point masses
        return DraftModelProposer(draft, "draft-tree", DraftModelConfig(num_speculative_tokens=2, top_children=2,
                                                                         max_nodes=4, kv_cache_bytes=8 << 20))
    if kind == "lookup":  # point masses, with two branches when two continuations exist
        return PromptLookupProposer(PromptLookupConfig(num_speculative_tokens=2, num_branches=2))
    raise ValueError(kind)


def exact_joint(hf, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """[V, V, V] float64: P(t1, t2, t3) from the reference model's logits through target_probs."""
    seqs = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    with torch.no_grad():
        logits = hf(seqs).logits.float()  # [V*V, len + 2, V]
    p1 = target_probs(logits[:1, -3], params)[0].double()  # after the prompt
    p2 = target_probs(logits[::VOCAB, -2], params).double()  # [a, t2]: after prompt + a
    p3 = target_probs(logits[:, -1], params).double().view(VOCAB, VOCAB, VOCAB)  # [a, b, t3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return (joint / joint.sum()).numpy()


def generate(target, proposer, prompt: list[int], params: dict, num_requests: int, seed0: int,
             max_tokens: int = MAX_TOKENS):
    eng = Engine(target, None,
                 EngineConfig(CacheConfig(block_size=4, kv_cache_bytes=8 << 20),
                              SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=1 << 16,
                                              max_num_prefills=num_requests)),
                 proposer=proposer)
    reqs = [eng.add_request(prompt, SamplingParams(seed=seed0 + i, max_tokens=max_tokens, ignore_eos=True, **params))
            for i in range(num_requests)]
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    samples = np.array([final[r.request_id] for r in reqs])
    assert samples.shape == (num_requests, max_tokens)
    return samples, eng.stats


def chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square of samples (rows of token ids) against the joint `probs` over the same
    index space; cells expected below MIN_EXPECTED are pooled. A sample in a cell of probability
    zero (a token top-k or top-p removed) is impossible under the target: p = 0."""
    n = len(samples)
    flat = np.ravel_multi_index(tuple(samples.T), probs.shape)
    counts = np.bincount(flat, minlength=probs.size).astype(np.float64)
    expected = probs.ravel() * n
    if counts[expected == 0].sum() > 0:
        return 0.0
    big = expected >= MIN_EXPECTED
    obs, exp = list(counts[big]), list(expected[big])
    rest_obs, rest_exp = counts[~big].sum(), expected[~big].sum()
    if rest_exp > 0:
        if rest_exp >= MIN_EXPECTED or not exp:
            obs.append(rest_obs)
            exp.append(rest_exp)
        else:  # the pooled cell is itself too small: add it to the smallest kept cell
            i = int(np.argmin(exp))
            obs[i] += rest_obs
            exp[i] += rest_exp
    assert len(exp) >= 3, "too few cells for a meaningful test"
    obs, exp = np.array(obs), np.array(exp)
    exp *= obs.sum() / exp.sum()  # chisquare wants equal totals; they differ only by rounding
    return float(scipy.stats.chisquare(obs, exp).pvalue)


def p_values(samples: np.ndarray, joint: np.ndarray) -> tuple[float, float]:
    """(p of the (t1, t2) joint, p of the (t1, t2, t3) joint)."""
    return chi_square_p(samples[:, :2], joint.sum(-1)), chi_square_p(samples, joint)


SEEDS = {(k, s): 1_000_000 * i for i, (k, s) in enumerate((k, s) for k in PROPOSERS for s in PARAMS)}


@pytest.mark.parametrize("setting", list(PARAMS))
@pytest.mark.parametrize("kind", PROPOSERS)
def test_output_distribution_matches_target(setup, kind, setting):
    hf, target, draft, prompt = setup
    joint = exact_joint(hf, prompt, SamplingParams(**PARAMS[setting]))
    n = NUM_REQUESTS[kind]
    samples, stats = generate(target, make_proposer(kind, draft), prompt, PARAMS[setting], n, SEEDS[(kind, setting)])
    # both branches of verification were exercised: some draft tokens kept, some rejected
    assert stats.num_drafted > n // 4
    assert 0.0 < stats.acceptance_rate < 1.0, stats.as_dict()
    p12, p123 = p_values(samples, joint)
    print(f"{kind}/{setting}: acceptance {stats.acceptance_rate:.3f}, p(t1,t2) = {p12:.4g}, p(t1,t2,t3) = {p123:.4g}")
    assert p12 > ALPHA, f"(t1, t2) distribution differs from the target's: p = {p12:.3g}"
    assert p123 > ALPHA, f"(t1, t2, t3) distribution differs from the target's: p = {p123:.3g}"


@pytest.mark.parametrize("setting", ["t1", "t1.3-p0.8"])
def test_seeded_sampling_with_point_mass_drafts_is_plain_sampling_token_for_token(setup, setting):
    """Rows whose children are all point masses are verified by coupling (core/verify.py): the uniform of
    output position t decides token t whatever was drafted, so a seeded request samples exactly the text
    plain decoding samples, for prompt lookup at two lengths and a deterministic draft-model tree alike.
    The control: a draft that samples (the chain, verified by rejection) keeps the distribution (above)
    but not the tokens, so the comparison does see a difference where there is one."""
    hf, target, draft, prompt = setup
    n, tokens = 200, 12
    plain, _ = generate(target, None, prompt, PARAMS[setting], n, 77_000, tokens)
    for proposer in (PromptLookupProposer(PromptLookupConfig(num_speculative_tokens=2, num_branches=2)),
                     PromptLookupProposer(PromptLookupConfig(num_speculative_tokens=5)),
                     make_proposer("tree", draft)):
        spec, stats = generate(target, proposer, prompt, PARAMS[setting], n, 77_000, tokens)
        assert stats.num_drafted > n and 0.0 < stats.acceptance_rate < 1.0, stats.as_dict()
        assert (spec == plain).all(), f"{(spec != plain).any(1).sum()} of {n} requests differ from plain sampling"
    chain, stats = generate(target, make_proposer("chain", draft), prompt, PARAMS[setting], n, 77_000, tokens)
    assert stats.num_drafted > n and (chain != plain).any(1).sum() > 0


# ------------------------------------------------------------------------------------------------
# power: deliberately lossy verifiers must be caught by the same statistic
# ------------------------------------------------------------------------------------------------
def _children(tree: DraftTree) -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for j, p in enumerate(tree.parents):
        table.setdefault(p, []).append(j)
    return table


def accept_every_draft(tree: DraftTree, probs: torch.Tensor, uniforms, position: int = 0) -> VerifyResult:
    """Wrong: follows the first child at every level without a test, then samples a bonus from p."""
    children, node, accepted = _children(tree), -1, []
    while children.get(node):
        node = children[node][0]
        accepted.append(node)
    return VerifyResult(accepted, draw_at(probs[node + 1], uniforms(position + len(accepted), 0)))


def forget_residual(tree: DraftTree, probs: torch.Tensor, uniforms, position: int = 0) -> VerifyResult:
    """Wrong: the right acceptance test, but after rejections it resamples from p itself instead of
    the residual norm(max(p - q, 0)), so rejected tokens come back too often."""
    children, node, accepted = _children(tree), -1, []
    while True:
        p = probs[node + 1]
        at = position + len(accepted)
        chosen = None
        for i, c in enumerate(children.get(node, [])):
            x = tree.token_ids[c]
            q_x = 1.0 if tree.draft_probs is None else float(tree.draft_probs[c][x])
            if q_x > 0 and uniforms(at, 1 + i) * q_x < float(p[x]):
                chosen = c
                break
        if chosen is None:
            return VerifyResult(accepted, draw_at(p, uniforms(at, 0)))
        accepted.append(chosen)
        node = chosen


@pytest.mark.parametrize("kind,setting,wrong,num_requests", [
    ("chain", "t1", forget_residual, 1000),
    ("chain", "t0.7-k3", accept_every_draft, 500),
    ("tree", "t1", forget_residual, 500),
    ("lookup", "t1.3-p0.8", accept_every_draft, 500),
], ids=["chain-t1-forget_residual", "chain-t0.7k3-accept_all", "tree-t1-forget_residual",
        "lookup-t1.3p0.8-accept_all"])
def test_wrong_verifier_is_detected(setup, monkeypatch, kind, setting, wrong, num_requests):
    hf, target, draft, prompt = setup
    monkeypatch.setattr(engine_module, "verify_sampled", wrong)
    joint = exact_joint(hf, prompt, SamplingParams(**PARAMS[setting]))
    samples, _ = generate(target, make_proposer(kind, draft), prompt, PARAMS[setting], num_requests,
                          SEEDS[(kind, setting)])
    p12, p123 = p_values(samples, joint)
    print(f"WRONG {wrong.__name__} {kind}/{setting}: p(t1,t2) = {p12:.3g}, p(t1,t2,t3) = {p123:.3g}")
    assert min(p12, p123) < ALPHA, f"the statistic missed a lossy verifier: p = {p12:.3g}, {p123:.3g}"
