"""Each verification rule and the target distribution, on hand-made inputs (no model involved).

Rows: row 0 is the root, row j + 1 is tree node j (see specfleet/core/verify.py).
Statistical checks use fixed seeds, so they are deterministic; their tolerances are binomial bounds
(Z standard deviations), not tuned numbers.
"""
import math

import numpy as np
import pytest
import torch

from specfleet.errors import InvalidRequestError
from specfleet.runtime.sample.sampling import target_probs
from specfleet.sampling_params import SamplingParams
from specfleet.core.tree import DraftTree
from specfleet.core.verify import VerifyResult, verify_greedy, verify_sampled

Z = 5.0  # a correct implementation fails a 5-sigma bound with probability ~6e-7 per check


def assert_binomial(counts: np.ndarray, probs, n: int) -> None:
    """Every empirical frequency lies within Z binomial standard deviations of its probability."""
    probs = np.asarray(probs, dtype=np.float64)
    for tok, (c, p) in enumerate(zip(counts, probs)):
        sd = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(c / n - p) <= Z * sd + 1e-12, f"token {tok}: frequency {c / n:.4f}, expected {p:.4f} (+-{Z * sd:.4f})"


def one_hot_rows(argmaxes: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float()


def assert_greedy_consistent(tree: DraftTree, argmax: list[int], res: VerifyResult) -> None:
    """The accepted path is a root-to-node path whose tokens are the argmax of the row before each
    node, and next_token is the argmax of the last accepted row: exactly what greedy decoding emits."""
    row = 0
    parent = -1
    for j in res.accepted_nodes:
        assert tree.parents[j] == parent, f"node {j} is not a child of {parent}"
        assert tree.token_ids[j] == argmax[row]
        parent, row = j, j + 1
    assert res.next_token == argmax[row]
    # and the path stopped only because no child of the last node matches
    assert all(tree.token_ids[c] != argmax[row] for c in tree.children(parent))


# ------------------------------------------------------------------------------------------------
# greedy
# ------------------------------------------------------------------------------------------------
def test_greedy_chain_fully_accepted_takes_bonus_from_last_row():
    tree = DraftTree.chain([3, 5, 7], "d")
    argmax = [3, 5, 7, 9]  # rows: root, node 0, node 1, node 2
    res = verify_greedy(tree, argmax)
    assert res.accepted_nodes == [0, 1, 2]
    assert res.next_token == 9
    assert res.emitted_tokens(tree) == [3, 5, 7, 9]
    assert res.num_accepted == 3


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_greedy_chain_rejection_at_position_k(k):
    drafts = [3, 5, 7, 2]
    argmax = drafts + [9]
    argmax[k] = 8  # the target disagrees with draft k
    tree = DraftTree.chain(drafts, "d")
    res = verify_greedy(tree, argmax)
    assert res.accepted_nodes == list(range(k))
    assert res.next_token == 8  # the correction comes from the row of the last accepted token
    assert res.emitted_tokens(tree) == drafts[:k] + [8]
    assert_greedy_consistent(tree, argmax, res)


def test_greedy_tree_second_branch_matches():
    #   root -> 4 -> 5        (branch A: nodes 0, 1)
    #        -> 6 -> 7 -> 1   (branch B: nodes 2, 3, 4)
    tree = DraftTree([4, 5, 6, 7, 1], [-1, 0, -1, 2, 3], ["d"] * 5)
    # rows: root, n0, n1, n2, n3, n4. Branch A's rows would continue it, but the root wants 6.
    argmax = [6, 5, 0, 7, 2, 3]
    res = verify_greedy(tree, argmax)
    assert res.accepted_nodes == [2, 3]  # 6, 7; node 4 (token 1) is rejected because row n3 wants 2
    assert res.next_token == 2
    assert res.emitted_tokens(tree) == [6, 7, 2]
    assert_greedy_consistent(tree, argmax, res)


def test_greedy_empty_tree_is_plain_argmax():
    res = verify_greedy(DraftTree(), [8])
    assert res.accepted_nodes == [] and res.next_token == 8
    assert res.emitted_tokens(DraftTree()) == [8]


def test_greedy_empty_tree_through_target_probs_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0]])  # tie: torch.argmax takes the first index
    res = verify_greedy(DraftTree(), logits.argmax(-1).tolist())
    assert res.next_token == 1


def test_greedy_duplicate_sibling_tokens():
    # two root children both carry token 4; only the second has a child (9)
    tree = DraftTree([4, 4, 9], [-1, -1, 1], ["a", "b", "b"])
    # rows: root, n0, n1, n2. Whichever duplicate is taken, the emitted text must be greedy's.
    for argmax in ([4, 9, 9, 3], [4, 1, 9, 3], [4, 9, 1, 3], [5, 9, 9, 3]):
        res = verify_greedy(tree, argmax)
        assert_greedy_consistent(tree, argmax, res)
    res = verify_greedy(tree, [5, 9, 9, 3])
    assert res.accepted_nodes == [] and res.next_token == 5


# ------------------------------------------------------------------------------------------------
# sampled, point-mass proposals (draft_probs is None)
# ------------------------------------------------------------------------------------------------
def test_sampled_point_mass_probability_one_always_accepted():
    tree = DraftTree.chain([2, 3], "pl")
    probs = one_hot_rows([2, 3, 5], 6)
    for seed in range(300):
        res = verify_sampled(tree, probs, torch.Generator().manual_seed(seed))
        assert res.accepted_nodes == [0, 1]
        assert res.next_token == 5


def test_sampled_point_mass_probability_zero_never_accepted():
    tree = DraftTree([2, 4, 1], [-1, -1, 0], ["pl"] * 3)  # root children 2 and 4, both impossible
    probs = torch.tensor([[0.25, 0.25, 0.0, 0.5, 0.0, 0.0]] + [[1 / 6] * 6] * 3)
    seen = set()
    for seed in range(300):
        res = verify_sampled(tree, probs, torch.Generator().manual_seed(seed))
        assert res.accepted_nodes == []
        assert probs[0, res.next_token] > 0
        seen.add(res.next_token)
    assert seen == {0, 1, 3}


def test_sampled_point_mass_worked_example_from_docstring():
    """p = {a: .5, b: .3, c: .2}, children [b, a]: the output is distributed exactly like p."""
    a, b, c = 0, 1, 2
    p = torch.tensor([[0.5, 0.3, 0.2], [1 / 3] * 3, [1 / 3] * 3])
    tree = DraftTree([b, a], [-1, -1], ["pl", "pl"])
    n = 20000
    g = torch.Generator().manual_seed(1234)
    counts = np.zeros(3, dtype=np.int64)
    for _ in range(n):
        res = verify_sampled(tree, p, g)
        tok = res.emitted_tokens(tree)[0]
        # the path says where the token came from: node 0 is b, node 1 is a, the residual gives c
        if tok == b:
            assert res.accepted_nodes == [0]
        elif tok == a:
            assert res.accepted_nodes == [1]
        else:
            assert tok == c and res.accepted_nodes == []
        counts[tok] += 1
    assert_binomial(counts, [0.5, 0.3, 0.2], n)


def test_sampled_point_mass_tree_is_lossless_on_random_rows():
    """Two levels of a tree with several siblings (a duplicate among them): P(first two tokens) = p."""
    vocab = 4
    gen = torch.Generator().manual_seed(7)
    # root children 1, 2, 1 (duplicate); node 0 (token 1) has children 0 and 3; node 1 (token 2) child 2
    tree = DraftTree([1, 2, 1, 0, 3, 2], [-1, -1, -1, 0, 0, 1], ["x"] * 6)
    rows = torch.softmax(torch.randn(7, vocab, generator=gen) * 1.5, -1)  # root + 6 nodes
    # the first token must follow row 0; after token 1 (reachable only through node 0, see below) the
    # second token must follow node 0's row, row 1, whether it is a child of node 0 or the residual
    n = 20000
    g = torch.Generator().manual_seed(99)
    first = np.zeros(vocab, dtype=np.int64)
    second_after_1 = np.zeros(vocab, dtype=np.int64)
    for _ in range(n):
        res = verify_sampled(tree, rows, g)
        toks = res.emitted_tokens(tree)
        first[toks[0]] += 1
        if toks[0] == 1:
            # token 1 was reached through node 0 or node 2; node 2 has no children, so its second
            # token would be a bonus from row 3. Node 0 is tried first and, if rejected, the residual
            # removes token 1, so node 2 (also token 1) can never be accepted.
            assert res.accepted_nodes[0] == 0
            second_after_1[toks[1]] += 1
    assert_binomial(first, rows[0].numpy(), n)
    assert_binomial(second_after_1, rows[1].numpy(), int(second_after_1.sum()))


# ------------------------------------------------------------------------------------------------
# sampled, with draft probabilities
# ------------------------------------------------------------------------------------------------
def test_sampled_chain_with_q_equal_p_always_accepts():
    vocab = 7
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        p = torch.softmax(torch.randn(4, vocab, generator=gen) * 2, -1)  # rows: root + 3 nodes
        q = p[:3].clone()  # node j was drawn from the row of its parent, which is row j
        tokens = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(3)]
        tree = DraftTree.chain(tokens, "d", q)
        res = verify_sampled(tree, p, torch.Generator().manual_seed(trial))
        assert res.accepted_nodes == [0, 1, 2]
        assert p[3, res.next_token] > 0


def test_sampled_residual_never_emits_where_p_le_q():
    vocab = 6
    gen = torch.Generator().manual_seed(11)
    rejections = 0
    for trial in range(600):
        logits_p = torch.randn(vocab, generator=gen) * 2
        logits_q = torch.randn(vocab, generator=gen) * 2
        p = torch.softmax(logits_p, -1)
        q = torch.softmax(logits_q, -1)
        x = int(torch.multinomial(q, 1, generator=gen))
        tree = DraftTree.chain([x], "d", q[None])
        rows = torch.stack([p, torch.full((vocab,), 1 / vocab)])
        res = verify_sampled(tree, rows, torch.Generator().manual_seed(trial))
        if not res.accepted_nodes:
            rejections += 1
            assert p[res.next_token] > q[res.next_token], (p, q, res)
    assert rejections > 50  # the branch under test was exercised


def test_sampled_draft_token_with_zero_target_probability_is_rejected():
    p = torch.tensor([[0.0, 0.6, 0.4], [1 / 3] * 3])
    q = torch.tensor([[0.9, 0.05, 0.05]])
    tree = DraftTree.chain([0], "d", q)
    for seed in range(200):
        res = verify_sampled(tree, p, torch.Generator().manual_seed(seed))
        assert res.accepted_nodes == [] and res.next_token in (1, 2)


@pytest.mark.parametrize("num_children", [1, 2, 3])
def test_sampled_with_draft_probs_is_lossless(num_children):
    """Classic speculative sampling (one child) and its multi-candidate form with independent
    draws: the output is distributed exactly like p, whatever q is."""
    p = torch.tensor([0.45, 0.05, 0.3, 0.0, 0.2])
    qs = torch.tensor([[0.1, 0.5, 0.1, 0.2, 0.1], [0.3, 0.3, 0.0, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
    qs = qs[:num_children]
    rows = torch.cat([p[None], torch.full((num_children, 5), 0.2)])
    n = 20000
    g = torch.Generator().manual_seed(100 + num_children)
    gd = torch.Generator().manual_seed(200 + num_children)
    draws = torch.multinomial(qs, n, replacement=True, generator=gd).T.tolist()  # child i ~ qs[i]
    counts = np.zeros(5, dtype=np.int64)
    for tokens in draws:
        tree = DraftTree(tokens, [-1] * num_children, ["d"] * num_children, qs)
        counts[verify_sampled(tree, rows, g).emitted_tokens(tree)[0]] += 1
    assert counts[3] == 0  # p(3) = 0 although every q proposes it
    assert_binomial(counts, p.numpy(), n)


# ------------------------------------------------------------------------------------------------
# target_probs
# ------------------------------------------------------------------------------------------------
def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 reference: softmax(logits / T), keep the top k, renormalise, keep the smallest
    prefix (by descending probability) whose mass reaches top_p, renormalise."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if 0 < top_k < len(p):
        keep = np.argsort(-p, kind="stable")[:top_k]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        out = np.zeros_like(p)
        mass = 0.0
        for i in order:
            out[i] = p[i]
            mass += p[i]
            if mass >= top_p:
                break
        p = out / out.sum()
    return p


def test_target_probs_top_k_keeps_exactly_k():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 20, generator=gen) * 3  # distinct values almost surely
    for k in (1, 2, 3, 7, 19):
        probs = target_probs(logits, SamplingParams(temperature=0.8, top_k=k))
        assert ((probs > 0).sum(-1) == k).all()
        top = torch.topk(logits, k, dim=-1).indices
        assert (torch.gather(probs, -1, top) > 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(16))
    for k in (0, -1, 20, 50):  # disabled, or not smaller than the vocabulary
        probs = target_probs(logits, SamplingParams(top_k=k))
        assert (probs > 0).all()


def test_target_probs_top_p_smallest_prefix_and_top_token():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 12, generator=gen) * 2
    for top_p in (1e-6, 0.1, 0.5, 0.8, 0.95, 0.999):
        probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        base = torch.softmax(logits.double(), -1)
        for r in range(logits.shape[0]):
            kept = probs[r] > 0
            assert kept[int(logits[r].argmax())], "the top token always stays"
            sp, order = base[r].sort(descending=True)
            cum = sp.cumsum(0)
            if (cum - top_p).abs().min() < 1e-5:
                continue  # too close to the boundary for a float32 vs float64 comparison
            n_keep = int((cum < top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
            expected = torch.zeros(12, dtype=torch.bool)
            expected[order[:n_keep]] = True
            assert torch.equal(kept, expected), (top_p, r)
            # the kept tokens keep their relative probabilities
            ref = torch.where(expected, base[r], 0.0)
            torch.testing.assert_close(probs[r].double(), ref / ref.sum(), atol=1e-6, rtol=0)
    assert (target_probs(logits, SamplingParams(top_p=1e-6)) > 0).sum(-1).eq(1).all()


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.5, 4, 0.6), (2.0, 6, 0.9), (1.0, 1, 0.3),
])
def test_target_probs_matches_reference_order_temperature_topk_topp(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(32, 10, generator=gen) * 2
    probs = target_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    for r in range(logits.shape[0]):
        ref = reference_probs(logits[r].numpy(), temperature, top_k, top_p)
        np.testing.assert_allclose(probs[r].numpy(), ref, atol=1e-5)


def test_target_probs_temperature_zero_is_one_hot_argmax():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 11, generator=gen)
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie: the first index wins, like torch.argmax
    probs = target_probs(logits, SamplingParams(temperature=0, top_k=2, top_p=0.5))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 11).float())
    assert probs[0, 3] == 1.0
    assert probs.dtype == torch.float32


@pytest.mark.parametrize("temperature", [1e-3, 1e-30, 1e-39, 1e-45, 5e-324])
def test_target_probs_tiny_temperature_is_finite_and_concentrates_on_argmax(temperature):
    """Any temperature validate() accepts must give a distribution (a nan row makes sampling raise)."""
    logits = torch.tensor([[1.0, 2.0, 0.5, -3.0], [40.0, -20.0, 39.0, 0.0], [0.2, 0.7, 0.7, 0.1]])
    for params in (SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_k=2),
                   SamplingParams(temperature=temperature, top_p=0.5)):
        probs = target_probs(logits, params)
        assert torch.isfinite(probs).all(), (temperature, probs)
        torch.testing.assert_close(probs.sum(-1), torch.ones(3))
        assert probs[0, 1] > 0.99 and probs[1, 0] > 0.99
        assert probs[2, 1] + probs[2, 2] > 0.99  # a tie at the top shares the mass
        torch.multinomial(probs, 1)


def test_target_probs_accepts_half_precision_logits():
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(5)).half()
    probs = target_probs(logits, SamplingParams(temperature=0.9, top_k=5, top_p=0.9))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.5),
    dict(temperature=float("nan")),
    dict(temperature=float("inf")),
    dict(temperature=True),
    dict(temperature="1.0"),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(top_p=-0.1),
    dict(top_p=float("nan")),
    dict(top_p=True),
    dict(max_tokens=0),
    dict(max_tokens=-3),
    dict(max_tokens=True),
    dict(max_tokens=2.0),
    dict(top_k=-5),
    dict(top_k=True),
    dict(top_k=2.5),
    dict(seed=-1),
    dict(seed=True),
])
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0), dict(temperature=0.0), dict(temperature=2), dict(top_k=-1), dict(top_k=0),
    dict(top_k=1), dict(top_p=1.0), dict(top_p=1), dict(top_p=1e-9), dict(max_tokens=1), dict(seed=0),
])
def test_valid_sampling_params_accepted(kwargs):
    SamplingParams(**kwargs).validate()


def test_validate_catches_mutation_after_construction():
    sp = SamplingParams()
    sp.temperature = -1.0
    with pytest.raises(InvalidRequestError):
        sp.validate()
    assert issubclass(InvalidRequestError, ValueError)


def test_draw_follows_the_distribution_and_never_draws_a_token_without_mass():
    from scipy.stats import chisquare

    from specfleet.core.verify import draw

    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    gen = torch.Generator().manual_seed(3)
    n = 20000
    counts = np.bincount([draw(probs * 3.0, gen) for _ in range(n)], minlength=7)  # unnormalized input
    assert counts[[0, 2, 6]].sum() == 0
    support = probs > 0
    assert chisquare(counts[support.numpy()], (probs[support] * n).numpy()).pvalue > 1e-3
    # a skewed row: the draw is not biased towards the front or the back of the vocabulary
    wide = torch.zeros(151936)
    wide[[5, 70000, 151935]] = torch.tensor([0.25, 0.5, 0.25])
    got = np.bincount([{5: 0, 70000: 1, 151935: 2}[draw(wide, gen)] for _ in range(4000)], minlength=3)
    assert chisquare(got, [1000, 2000, 1000]).pvalue > 1e-3
    # the same generator state gives the same draw
    assert draw(probs, torch.Generator().manual_seed(9)) == draw(probs, torch.Generator().manual_seed(9))


def test_keyed_uniforms_are_uniform_and_depend_only_on_key_position_and_index():
    from scipy.stats import kstest

    from specfleet.core.verify import KeyedUniforms

    u = KeyedUniforms(2024)
    draws = np.array([u(t, i) for t in range(5000) for i in range(4)])
    assert ((0.0 <= draws) & (draws < 1.0)).all()
    assert kstest(draws, "uniform").pvalue > 1e-3
    # neighbouring positions, indices and keys are not correlated
    assert abs(np.corrcoef(draws[:-4], draws[4:])[0, 1]) < 0.05
    other = np.array([KeyedUniforms(2025)(t, 0) for t in range(5000)])
    assert abs(np.corrcoef(draws[::4], other)[0, 1]) < 0.05
    assert u(17, 3) == KeyedUniforms(2024)(17, 3) != u(17, 2)  # a function, not a stream


def test_point_mass_rows_emit_the_tokens_the_positions_uniforms_pick():
    """Coupled verification: each emitted token is the draw of its row by u(position, 0), so the tree's
    shape decides only how many tokens one step keeps, never which tokens they are."""
    from specfleet.core.verify import KeyedUniforms, draw_at

    vocab = 5
    gen = torch.Generator().manual_seed(8)
    tree = DraftTree([1, 2, 0, 3, 2], [-1, -1, 0, 0, 1], ["x"] * 5)
    kept = 0
    for trial in range(300):
        rows = torch.softmax(torch.randn(6, vocab, generator=gen) * 2, -1)
        u = KeyedUniforms(trial)
        res = verify_sampled(tree, rows, u, position=40)
        path_rows = [0] + [j + 1 for j in res.accepted_nodes]
        assert res.emitted_tokens(tree) == [draw_at(rows[r], u(40 + d, 0)) for d, r in enumerate(path_rows)]
        kept += res.num_accepted
    assert kept > 100  # the tree's children were accepted often, not only the bonus draws checked
