"""Each strategy's rule on hand-made inputs: vote paths and ties, weight thresholds, the length
controller's direction and bounds, matching against brute force, the bandit settling, n-gram backoff."""
import itertools
import random

import numpy as np
import pytest
import torch

from specfleet.engine.request import Request
from specfleet.errors import InvalidRequestError
from specfleet.sampling_params import SamplingParams
from specfleet.strategies.length import LengthConfig, LengthController, LengthMonitor, prune_depth
from specfleet.core.proposer import Feedback
from specfleet.strategies.selector import SelectorConfig, SelectorProposer, max_weight_matching
from specfleet.core.tree import DraftTree
from specfleet.strategies.vote import VoteConfig, VoteProposer, first_path, weighted_vote


class Fixed:
    """A stub proposer that drafts the same chain for every request and counts its calls."""

    def __init__(self, name, tokens, probs=None):
        self.name, self.tokens, self.probs = name, tokens, probs
        self.calls, self.observed, self.released = 0, [], []

    def propose(self, requests):
        self.calls += 1
        return {r.request_id: DraftTree.chain(self.tokens, self.name, self.probs) for r in requests} if self.tokens else {}

    def observe(self, feedback):
        self.observed.extend(feedback)

    def release(self, request_id):
        self.released.append(request_id)


def request(i, prompt_len=5, temperature=0.0):
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(temperature=temperature, max_tokens=64))


def feedback(req, tree, accepted, verify_time=0.01):
    return Feedback(req.request_id, tree, list(range(accepted)), accepted + 1, verify_time, req.all_token_ids)


# -- Minions vote ------------------------------------------------------------------------------
def test_vote_takes_the_heaviest_child_at_each_level():
    x, y, z, w = 1, 2, 3, 4
    seqs = [[x, y], [x, z], [w]]
    assert weighted_vote(seqs, [1, 1, 1.5]) == 0  # "x" (2) beats "w" (1.5); y/z tie -> A, listed first
    assert weighted_vote(seqs, [1, 1, 2.5]) == 2  # "w" now outweighs A + B
    assert weighted_vote(seqs, [1, 1.2, 1.5]) == 1  # "x" (2.2) then "z" (1.2) beats "y" (1)


def test_vote_ties_break_to_the_first_listed():
    assert weighted_vote([[5, 6], [7, 8]], [1, 1]) == 0
    assert weighted_vote([[7, 8], [5, 6]], [1, 1]) == 0
    assert weighted_vote([[5, 6], [5, 6], [9]], [1, 1, 1.5]) == 0  # identical sequences: the first
    assert weighted_vote([[5], [5, 6]], [1, 1]) == 1  # the path continues to the longer sequence's leaf


def test_vote_proposer_verifies_one_real_sequence_and_records_the_winner():
    a, b, c = Fixed("a", [1, 2, 3]), Fixed("b", [1, 2, 4]), Fixed("c", [9, 9])
    vote = VoteProposer([a, b, c])
    reqs = [request(0)]
    tree = vote.propose(reqs)["r0"]
    assert tree.token_ids == [1, 2, 3] and tree.origins == ["a"] * 3 and tree.is_chain
    assert vote.wins == [1, 0, 0]
    vote.observe([feedback(reqs[0], tree, 3)])  # only the winner learns
    assert len(a.observed) == 1 and not b.observed and not c.observed


def test_sampled_requests_take_the_heaviest_chain_or_vote_with_point_masses():
    probs = torch.full((2, 5), 0.2)
    voters = [Fixed("a", [1, 2], probs), Fixed("b", [3, 4], probs), Fixed("c", [3, 4])]
    greedy, sampled = request(0), request(1, temperature=1.0)
    heaviest = VoteProposer(voters)
    out = heaviest.propose([greedy, sampled])
    assert out["r0"].token_ids == [3, 4] and out["r0"].draft_probs is None  # greedy: b and c outvote a
    # sampled: the choice must not depend on the sampled tokens, so weights alone decide (a ties first)
    assert out["r1"].token_ids == [1, 2] and torch.equal(out["r1"].draft_probs, probs)
    voted = VoteProposer(voters, VoteConfig(sampled="vote")).propose([sampled])["r1"]
    assert voted.token_ids == [3, 4] and voted.draft_probs is None  # chosen for its tokens: point masses
    lone = VoteProposer([Fixed("a", [1, 2], probs), Fixed("b", [])], VoteConfig(sampled="vote"))
    assert lone.propose([sampled])["r1"].draft_probs is not None  # no choice was made


def test_first_path_of_a_tree_follows_first_children():
    tree = DraftTree([1, 2, 3, 4], [-1, -1, 0, 0], ["t"] * 4)
    assert first_path(tree) == [0, 2]


def test_weights_move_only_past_the_thresholds():
    cfg = VoteConfig(reward_threshold=0.6, punish_threshold=0.3, reward_factor=2.0, punish_factor=0.5)
    vote = VoteProposer([Fixed("a", [1]), Fixed("b", [2]), Fixed("c", [3])], cfg)
    vote.update_weights({0: [0.6], 1: [0.3], 2: [0.45]})  # exactly at the thresholds, and between
    assert vote.weights == {"a": 1.0, "b": 1.0, "c": 1.0}
    vote.update_weights({0: [0.7, 0.6], 1: [0.2, 0.3]})  # means 0.65 > 0.6 and 0.25 < 0.3
    assert vote.weights == {"a": 2.0, "b": 0.5, "c": 1.0}
    for _ in range(40):
        vote.update_weights({0: [1.0], 1: [0.0]})
    assert vote.weights["a"] == cfg.max_weight and vote.weights["b"] == cfg.min_weight


def test_a_punished_leader_loses_the_vote():
    a, b = Fixed("a", [1, 2]), Fixed("b", [3, 4])
    vote = VoteProposer([a, b], VoteConfig(punish_factor=0.5))
    for step in range(3):
        reqs = [request(step)]
        tree = vote.propose(reqs)["r%d" % step]
        vote.observe([feedback(reqs[0], tree, 2 if tree.origins[0] == "b" else 0)])  # the target agrees with b
    assert vote.wins == [1, 2]  # a led on the tie, was punished once, and b took over
    assert vote.weights == {"a": 0.5, "b": pytest.approx(1.21)}


def test_vote_needs_distinct_drafts():
    with pytest.raises(InvalidRequestError, match="twice"):
        VoteProposer([Fixed("a", [1]), Fixed("a", [2])])
    with pytest.raises(InvalidRequestError, match="punish_threshold"):
        VoteProposer([Fixed("a", [1]), Fixed("b", [2])], VoteConfig(reward_threshold=0.2, punish_threshold=0.5))


# -- Minions adaptive length -------------------------------------------------------------------
def drive(monitor, cost, steps):
    """Feed cost(s) for `steps` observations; return the lengths visited."""
    seen = []
    for _ in range(steps):
        monitor.record(cost(monitor.length))
        seen.append(monitor.length)
    return seen


def test_length_rises_while_cost_falls_and_stops_at_the_maximum():
    m = LengthMonitor(LengthConfig(max_length=6, decision_threshold=3), initial=2)
    drive(m, lambda s: 10.0 / (s + 1), 40)  # longer is always cheaper per token
    assert m.length == 6


def test_length_goes_down_to_zero_when_speculation_does_not_pay():
    m = LengthMonitor(LengthConfig(max_length=8, decision_threshold=3), initial=4)
    seen = drive(m, lambda s: 1.0 + 0.5 * s, 60)  # every drafted token makes tokens dearer (large batch)
    assert m.length == 0 and seen[-10:] == [0] * 10
    assert m.direction == -1  # the last move was down; it stays at its bound while costs stay flat


def test_a_rising_cost_moves_the_length_back_and_a_falling_one_continues():
    m = LengthMonitor(LengthConfig(decision_threshold=3), initial=4)
    for y in (10, 11, 12):  # rising since the start (which counts as an increase)
        m.record(y)
    assert (m.length, m.direction) == (3, -1)
    for y in (9, 9, 9):  # cheaper than at 4: the decrease paid off, continue down
        m.record(y)
    assert (m.length, m.direction) == (2, -1)
    for y in (12, 12, 12):  # dearer than at 3: overshot, move back up
        m.record(y)
    assert (m.length, m.direction) == (3, +1)
    assert m.history == [(3, 3), (6, 2), (9, 3)]


def test_the_fit_weights_steps_by_their_tokens():
    """At 5 the window's time per token is (5 + 3 + 5) / 11 = 1.18 against 1.2 at 4: cheaper, though one
    step kept a single token (y = 3). Weighted by tokens the fit falls and the controller continues up;
    Minions' unweighted fit sees the outlier as a rise and moves back."""
    lengths = {}
    for weights in ("tokens", "none"):
        m = LengthMonitor(LengthConfig(decision_threshold=3, fit_weights=weights), initial=4)
        for _ in range(3):
            m.record(1.2, 5)
        assert m.length == 5  # a flat first window probes upwards
        for y, n in ((1.0, 5), (3.0, 1), (1.0, 5)):
            m.record(y, n)
        lengths[weights] = m.length
    assert lengths == {"tokens": 6, "none": 4}
    with pytest.raises(InvalidRequestError, match="fit_weights"):
        LengthMonitor(LengthConfig(fit_weights="steps"), initial=4)


def test_a_rise_within_the_tolerance_counts_as_flat():
    """Neighbouring lengths that cost the same (+2 % noise) do not turn the controller around."""
    for tol, expected in ((0.05, (6, +1)), (0.0, (4, -1))):
        m = LengthMonitor(LengthConfig(decision_threshold=3, flat_tolerance=tol), initial=4)
        for y in (10, 10, 10):  # flat first window: probe upwards
            m.record(y)
        assert m.length == 5
        for y in (10.0, 10.1, 10.2):  # ~1 % up across the window: noise
            m.record(y)
        assert (m.length, m.direction) == expected


def test_at_a_bound_the_controller_probes_inwards_every_few_decisions():
    for probe_every, expected in ((3, [0, 0, 0, 0, 0, 1, 1, 2]), (0, [0] * 8)):
        m = LengthMonitor(LengthConfig(decision_threshold=2, probe_every=probe_every), initial=1)
        for y in (10, 12):  # rise: go down to 0
            m.record(y)
        assert (m.length, m.direction) == (0, -1)
        visited = []
        for _ in range(8):  # flat at 0: two blocked decisions, the third probes up to 1; flat there too
            m.record(5.0)
            visited.append(m.length)
        assert visited == expected


def test_decisions_wait_for_the_threshold():
    m = LengthMonitor(LengthConfig(decision_threshold=5), initial=4)
    for y in (1, 2, 3, 4):
        assert not m.record(y)
    assert m.length == 4 and m.record(5) and m.length == 3


def test_length_settles_around_the_cheapest_length():
    m = LengthMonitor(LengthConfig(max_length=8, decision_threshold=3), initial=1)
    seen = drive(m, lambda s: (s - 3) ** 2 + 5.0, 120)
    assert set(seen[-30:]) <= {2, 3, 4}


def test_length_controller_at_zero_does_not_call_the_draft():
    inner = Fixed("a", [1, 2, 3, 4])
    ctl = LengthController(inner, LengthConfig(initial_length=0, min_length=0), initial=4)
    assert ctl.length == 0 and ctl.propose([request(0)]) == {} and inner.calls == 0
    ctl.set_num_speculative_tokens(2)
    tree = ctl.propose([request(0)])["r0"]
    assert len(tree) == 2 and inner.calls == 1  # Fixed has no length setting: its trees are cut


def test_prune_depth_keeps_a_valid_tree():
    tree = DraftTree([1, 2, 3, 4, 5], [-1, 0, -1, 1, 2], ["t"] * 5, torch.eye(5))
    cut = prune_depth(tree, 2)
    assert cut.token_ids == [1, 2, 3, 5] and cut.parents == [-1, 0, -1, 2]
    assert torch.equal(cut.draft_probs, torch.eye(5)[[0, 1, 2, 4]])


def test_length_config_is_checked():
    with pytest.raises(InvalidRequestError, match="min_length"):
        LengthConfig(min_length=5, max_length=3).validate()


# -- SPIN matching and bandit ------------------------------------------------------------------
def brute_force(weights, caps):
    n, m = weights.shape
    best = 0.0
    for choice in itertools.product(range(-1, m), repeat=n):
        if all(sum(1 for c in choice if c == j) <= caps[j] for j in range(m)):
            best = max(best, sum(weights[i, c] for i, c in enumerate(choice) if c >= 0))
    return best


def test_matching_respects_capacities_and_equals_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n, m = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        weights = rng.random((n, m)) * 10
        caps = [int(c) for c in rng.integers(0, 4, size=m)]
        arms = max_weight_matching(weights, caps)
        for j in range(m):
            assert sum(1 for a in arms if a == j) <= caps[j]
        total = sum(weights[i, a] for i, a in enumerate(arms) if a >= 0)
        assert total == pytest.approx(brute_force(weights, caps))


def run_bandit(config, rewards, num_requests=4, steps=80):
    """Requests on stub arms; arm j's steps emit rewards[j] tokens per (simulated) second."""
    arms = [Fixed(f"arm{j}", [7]) for j in range(len(rewards))]
    sel = SelectorProposer(arms, config)
    reqs = [request(i) for i in range(num_requests)]
    history = []
    for _ in range(steps):
        trees = sel.propose(reqs)
        fbs = []
        for r in reqs:
            arm = sel.assignment[r.request_id]
            r.output_token_ids.extend([7] * rewards[arm])
            fbs.append(Feedback(r.request_id, trees[r.request_id], [0] * (rewards[arm] - 1), rewards[arm], 1.0,
                                r.all_token_ids))
        sel.observe(fbs)
        history.append([sel.assignment[r.request_id] for r in reqs])
    return sel, history


def test_spin_settles_on_the_best_arm():
    sel, history = run_bandit(SelectorConfig(exploration_steps=4, chunk_steps=2, seed=3), [1, 3, 2])
    assert history[-1] == [1, 1, 1, 1]  # in the late, long exploitation stage
    assert sel.estimates.arm_mean(1) > sel.estimates.arm_mean(2) > sel.estimates.arm_mean(0)
    assert any(len(set(h)) > 1 for h in history[:8])  # it did explore


def test_spin_matching_fills_the_best_arm_up_to_its_capacity():
    _, history = run_bandit(SelectorConfig(exploration_steps=4, chunk_steps=2, capacities="0:2:0"), [1, 3, 2])
    assert sorted(history[-1]) == [1, 1, 2, 2]
    assert all(sum(1 for a in h if a == 1) <= 2 for h in history)  # never above capacity, exploring or not


def test_epsilon_greedy_mostly_exploits_and_prompt_length_orders_by_size():
    _, history = run_bandit(SelectorConfig(policy="epsilon-greedy", epsilon=0.2, seed=1), [1, 3, 2], steps=100)
    late = [a for h in history[50:] for a in h]
    assert late.count(1) / len(late) > 0.7
    sel = SelectorProposer([Fixed("a", [1]), Fixed("b", [1])], SelectorConfig(policy="prompt-length"))
    reqs = [request(i, prompt_len=n) for i, n in enumerate([30, 5, 20, 10])]
    sel.propose(reqs)
    assert [sel.assignment[r.request_id] for r in reqs] == [1, 0, 1, 0]  # equal sizes: listed order


def test_selector_config_errors_are_clear():
    with pytest.raises(InvalidRequestError, match="policy"):
        SelectorProposer([Fixed("a", [1]), Fixed("b", [1])], SelectorConfig(policy="best"))
    with pytest.raises(InvalidRequestError, match="capacities"):
        SelectorProposer([Fixed("a", [1]), Fixed("b", [1])], SelectorConfig(capacities="1:x"))
