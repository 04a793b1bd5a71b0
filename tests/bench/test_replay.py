"""benchmarks/drafts/replay.py: the greedy-output replay that compares drafting policies without the target."""
import importlib.util
from pathlib import Path

import pytest

from specfleet.core.tree import DraftTree

spec = importlib.util.spec_from_file_location("bench_replay", Path(__file__).parents[2] / "benchmarks" / "drafts" / "replay.py")
bench_replay = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_replay)

OUTPUT = [(7 * i + 3) % 50 for i in range(20)]


class Knows:
    """Proposes the next `k` tokens of OUTPUT, the `wrong`-th of them (1-based) replaced by -1."""

    def __init__(self, name, k, wrong=None):
        self.name, self.k, self.wrong, self.seen = name, k, wrong, []

    def propose(self, requests):
        r = requests[0]
        done = r.num_tokens - len(r.prompt_token_ids)
        toks = OUTPUT[done:done + self.k]
        if self.wrong is not None and len(toks) >= self.wrong:
            toks[self.wrong - 1] = -1
        return {r.request_id: DraftTree.chain(toks, self.name)} if toks else {}

    def observe(self, feedback):
        self.seen += [fb.num_accepted for fb in feedback]

    def release(self, request_id):
        pass


def test_a_perfect_chain_emits_k_plus_one_per_step_at_c_of_k():
    c = [1.0, 1.2, 1.4, 1.6, 1.8]
    res = bench_replay.replay(Knows("k3", 3), [[1, 2]], [OUTPUT], c, 0.05)
    # 20 tokens: four steps of 3 accepted + 1, then 4 left: 3 proposed, only 2 may be accepted (the
    # target's own token ends the output), then nothing is left to propose
    assert res["tokens"] == 20 and res["steps"] == 5
    assert res["verify_plain_steps"] == pytest.approx(5 * 1.6, abs=0.01)
    assert res["speedup"] == pytest.approx(20 / (8.0 + res["draft_s"] / 0.05), rel=1e-3)


def test_a_rejected_node_ends_the_accepted_path_and_is_still_paid_for():
    c = [1.0, 1.2, 1.4, 1.6, 1.8]
    draft = Knows("bad2", 3, wrong=2)
    res = bench_replay.replay(draft, [[1, 2]], [OUTPUT], c, 0.05)
    assert set(draft.seen[:-1]) == {1}  # the first node is right, the second never
    assert res["tokens"] == 20 and res["steps"] == 10  # 1 accepted + the target's token each step
    assert res["nodes_per_step"] == pytest.approx(2.9, abs=0.01)  # 3 nodes, 2 at the end of the output


def test_the_oracle_verifies_only_the_longest_confirmed_path():
    c = [1.0, 1.2, 1.4, 1.6, 1.8]
    short, long_ = Knows("short", 1), Knows("long", 4, wrong=4)
    res = bench_replay.replay(None, [[1, 2]], [OUTPUT], c, 0.05, oracle=[short, long_])
    # the long draft's first three nodes are right: 4 tokens a step, verified at c(3)
    assert res["nodes_per_step"] == pytest.approx(3.0, abs=0.3)
    assert res["tokens"] == 20 and res["steps"] == 5
    assert short.seen and long_.seen  # both drafts learn from every step
