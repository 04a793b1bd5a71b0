"""Metric conventions on hand-made steps (see specfleet/core/stats.py)."""
import pytest

from specfleet.core.stats import SpecStats


def test_conventions_on_hand_made_steps():
    s = SpecStats()
    s.record_step(num_drafted=4, num_accepted=4, num_emitted=5, proposer="a")  # all accepted + bonus
    s.record_step(num_drafted=4, num_accepted=1, num_emitted=2, proposer="b")
    s.record_step(num_drafted=0, num_accepted=0, num_emitted=1, proposer=None)  # no draft this step
    s.draft_time, s.verify_time = 1.0, 3.0
    assert s.acceptance_rate == pytest.approx(5 / 8)
    assert s.mean_accepted_length == pytest.approx((5 + 3) / 3)
    assert s.acceptance_by_position == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert s.goodput == pytest.approx(8 / 4.0)
    assert s.acceptance_by_draft() == {"a": 1.0, "b": 0.25}
    assert s.drafts_used == {"a": 1, "b": 1}


def test_merge_adds_everything():
    a, b = SpecStats(), SpecStats()
    a.record_step(3, 2, 3, "x")
    b.record_step(2, 2, 3, "x")
    b.record_step(5, 0, 1, "y")
    a.merge(b)
    assert (a.num_steps, a.num_drafted, a.num_accepted, a.num_emitted) == (3, 10, 4, 7)
    assert a.accepted_at_depth == [2, 2]
    assert a.acceptance_by_draft() == {"x": 0.8, "y": 0.0}


def test_plain_decoding_scores_one():
    s = SpecStats()
    for _ in range(5):
        s.record_step(0, 0, 1, None)
    assert s.mean_accepted_length == 1.0 and s.acceptance_rate == 0.0


def test_per_token_acceptance_counts_the_first_rejection_not_the_tokens_after_it():
    s = SpecStats()
    s.record_step(num_drafted=4, num_accepted=4, num_emitted=5, proposer="a", num_judged=4)  # whole chain kept
    s.record_step(num_drafted=4, num_accepted=1, num_emitted=2, proposer="a", num_judged=2)  # 2nd rejected
    s.record_step(num_drafted=4, num_accepted=0, num_emitted=1, proposer="a", num_judged=1)  # 1st rejected
    assert s.acceptance_rate == pytest.approx(5 / 12)  # per drafted token: the tokens after a rejection count
    assert s.per_token_acceptance == pytest.approx(5 / 7)
    assert s.per_token_acceptance_by_position == pytest.approx([2 / 3, 1 / 2, 1, 1])
    other = SpecStats()
    other.record_step(2, 1, 2, "a", 2)
    s.merge(other)
    assert s.num_judged == 9 and s.judged_at_depth == [4, 3, 1, 1]
    assert s.as_dict()["per_token_acceptance"] == pytest.approx(6 / 9, abs=1e-4)
    with pytest.raises(ValueError, match="judged depths"):
        s.record_step(4, 1, 2, "a", 3)
