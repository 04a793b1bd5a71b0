"""SPIN's learning-based draft selection: each request drafts with one of several proposers ("arms").

Which draft serves a request best (accepted tokens per second: its goodput) is unknown up front, so
selection is a multi-armed bandit played in epochs (SPIN, Algorithm 1). Epoch k is
- an exploration stage of `exploration_steps` steps, cut into chunks of `chunk_steps` steps; at each
  chunk every request gets a random arm among those with batch capacity left, and keeps it for the
  chunk (switching costs a KV catch-up, so not every step);
- an exploitation stage of 2^k steps (at most `max_exploit_steps`), in which requests are assigned by
  a maximum-weight matching of estimated goodput under the per-arm capacities.

One step of one request contributes the tokens it emitted and its time: its share of the
verification plus its share of its arm's drafting. A step without a draft (the arm had nothing to
offer) counts too, as its tokens over the average verification share, so an arm that rarely drafts
is not flattered. Goodput is cumulative tokens / cumulative time, per (request, arm) shrunk towards
the arm's over all requests with weight `prior_weight` (the arm's alone for a pair never tried).

Matching: arm j with capacity B_j becomes B_j identical columns, and the assignment problem over
requests x columns is solved exactly (scipy's linear_sum_assignment, maximizing).

Switching ahead (SPIN's fast switching): the next block's assignment is decided one step early
(exploitation's matching then uses the estimates of all but the last exploration step), and the
destination drafts catch up on the switching requests' committed tokens then, optionally in a
background thread that overlaps the target's verification; any later call joins it first.

Baselines (`policy`): "epsilon-greedy": every chunk each request explores a random arm with
probability `epsilon`, else takes the arm with the best mean goodput; "prompt-length": every chunk
requests are ranked by prompt length and split evenly, shortest to the smallest draft (by parameter
count), as in SPIN's greedy baseline.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from specfleet.errors import InvalidRequestError
from specfleet.core.proposer import (DraftWeights, RequestSnapshot, free_kv, leaves, model_size, prepare_kv,
                                     set_speculation_length, speculation_length)
from specfleet.core.proposer import Feedback, Proposer
from specfleet.core.tree import DraftTree

POLICIES = ("spin", "epsilon-greedy", "prompt-length")


@dataclass(frozen=True)
class SelectorConfig:
    policy: str = "spin"
    exploration_steps: int = 8  # SPIN's alpha: steps of each exploration stage
    chunk_steps: int = 2  # SPIN's beta: steps a request keeps a random arm while exploring
    max_exploit_steps: int = 256  # cap on 2^k, so a long-running server keeps re-exploring
    capacity: int = 0  # batch capacity B_j of every arm; 0 = unlimited
    capacities: str = ""  # per-arm capacities "8:4:0", overriding `capacity`
    prior_weight: float = 1.0  # pseudo-observations of the arm's mean in a (request, arm) estimate
    epsilon: float = 0.2  # exploration probability of the epsilon-greedy baseline
    seed: int = 0
    prepare_ahead: bool = True  # catch switching requests up on their next draft one step early
    prepare_in_thread: bool = False  # ... in a background thread overlapping the verification

    def validate(self, num_arms: int) -> list[int]:
        """Raises on a bad setting; returns every arm's capacity (0 = unlimited)."""
        def bad(msg: str):
            raise InvalidRequestError(f"select: {msg}")

        if self.policy not in POLICIES:
            bad(f"unknown policy {self.policy!r}; choose one of {POLICIES}")
        if min(self.exploration_steps, self.chunk_steps, self.max_exploit_steps) < 1:
            bad("exploration_steps, chunk_steps and max_exploit_steps must be >= 1")
        if not 0.0 <= self.epsilon <= 1.0 or self.prior_weight < 0:
            bad("need 0 <= epsilon <= 1 and prior_weight >= 0")
        try:
            caps = [int(c) for c in self.capacities.split(":")] if self.capacities else [self.capacity] * num_arms
        except ValueError:
            caps = []
        if len(caps) != num_arms or min(caps) < 0:
            bad(f"capacities={self.capacities!r} / capacity={self.capacity} must give {num_arms} non-negative "
                f"integers (per-arm capacities separated by ':'; 0 = unlimited)")
        return caps


def max_weight_matching(weights: np.ndarray, capacities: list[int]) -> list[int]:
    """Arm of each request (-1: none) maximizing the total weight with at most capacities[j] requests
    on arm j. weights: [num_requests, num_arms], non-negative (so a maximum matching is also of
    maximum weight: adding a pair never lowers the total)."""
    n = weights.shape[0]
    cols = [j for j, c in enumerate(capacities) for _ in range(min(c, n))]  # arm j as c identical slots
    if n == 0 or not cols:
        return [-1] * n
    rows, picked = linear_sum_assignment(weights[:, cols], maximize=True)
    out = [-1] * n
    for r, c in zip(rows, picked):
        out[r] = cols[c]
    return out


class GoodputEstimates:
    """Cumulative throughput (tokens over seconds, SPIN's "averaging cumulative throughput") per
    arm and per (request, arm); a ratio of sums, so a step with a tiny time share cannot dominate."""

    def __init__(self, num_arms: int, prior_weight: float):
        self.prior_weight = prior_weight
        self.arm_tokens = [0.0] * num_arms
        self.arm_time = [0.0] * num_arms
        self.pair: dict[tuple[str, int], list[float]] = {}  # (request, arm) -> [tokens, seconds, steps]

    def add(self, request_id: str, arm: int, tokens: float, seconds: float) -> None:
        self.arm_tokens[arm] += tokens
        self.arm_time[arm] += seconds
        s = self.pair.setdefault((request_id, arm), [0.0, 0.0, 0])
        s[0] += tokens
        s[1] += seconds
        s[2] += 1

    def arm_mean(self, arm: int) -> float:
        return self.arm_tokens[arm] / self.arm_time[arm] if self.arm_time[arm] > 0 else 0.0

    def matrix(self, request_ids: list[str]) -> np.ndarray:
        """[requests, arms] estimated goodput: the pair's own, shrunk towards its arm's by
        `prior_weight` pseudo-steps (the arm's alone for a pair never tried)."""
        means = [self.arm_mean(j) for j in range(len(self.arm_tokens))]
        g = np.tile(np.array(means), (len(request_ids), 1))
        w = self.prior_weight
        for i, rid in enumerate(request_ids):
            for j, mean in enumerate(means):
                pair = self.pair.get((rid, j))
                if pair is not None and pair[1] > 0:
                    g[i, j] = (pair[2] * pair[0] / pair[1] + w * mean) / (pair[2] + w)
        return g

    def forget(self, request_id: str) -> None:
        for j in range(len(self.arm_tokens)):
            self.pair.pop((request_id, j), None)


class SelectorProposer:
    def __init__(self, arms: list[Proposer], config: SelectorConfig | None = None, name: str | None = None):
        names = [a.name for a in arms]
        if len(arms) < 2:
            raise InvalidRequestError("select(...) needs at least two drafts to choose between")
        if len(set(names)) != len(names):
            raise InvalidRequestError(f"select(...) lists a draft twice: {names}")
        self.config = config or SelectorConfig()
        self.capacities = self.config.validate(len(arms))
        self.children = self.arms = list(arms)
        self.name = name or f"select({','.join(names)})"
        self.rng = random.Random(self.config.seed)
        self.estimates = GoodputEstimates(len(arms), self.config.prior_weight)
        self.assignment: dict[str, int] = {}  # request id -> arm (-1: no draft this block)
        self._sizes = [model_size(a) for a in arms]
        self._blocks = self._block_plan()
        self._block, self._block_left = next(self._blocks)
        self._upcoming = next(self._blocks)
        self._next: dict[str, int] | None = None  # the next block's assignment, decided a step early
        self._pending: dict[str, tuple] = {}  # request id -> (request, arm, num_tokens, draft share, drafted)
        self._verify_share: float | None = None
        self._dropped: set[str] = set()
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._stats = [{"drafted": 0, "accepted": 0} for _ in arms]
        self.num_steps = 0
        self.overhead_s = {"matching": 0.0, "bookkeeping": 0.0}

    @property
    def weights(self) -> dict[str, float]:
        """Arm name -> estimated goodput (tokens/s), plus nested weights as "arm/voter"."""
        out = {a.name: self.estimates.arm_mean(j) for j, a in enumerate(self.arms)}
        for a in self.arms:
            if isinstance(a, DraftWeights):
                out.update({f"{a.name}/{k}": v for k, v in a.weights.items()})
        return out

    @property
    def draft_stats(self) -> dict[str, dict]:
        """Arm name -> drafted / accepted tokens of the drafts it made."""
        return {a.name: dict(s) for a, s in zip(self.arms, self._stats)}

    # -- the epoch plan --------------------------------------------------------------------------
    def _block_plan(self):
        cfg = self.config
        if cfg.policy != "spin":
            while True:
                yield cfg.policy, cfg.chunk_steps
        k = 1
        while True:
            for start in range(0, cfg.exploration_steps, cfg.chunk_steps):
                yield "explore", min(cfg.chunk_steps, cfg.exploration_steps - start)
            yield "exploit", min(2 ** k, cfg.max_exploit_steps)
            k += 1

    def _decide(self, kind: str, requests: list, fixed: dict[str, int]) -> dict[str, int]:
        """Arms for `requests` (not in `fixed`), within the capacity that `fixed` leaves."""
        left = [c or len(requests) + len(fixed) for c in self.capacities]
        for arm in fixed.values():
            if arm >= 0:
                left[arm] -= 1
        todo = [r for r in requests if r.request_id not in fixed]
        out: dict[str, int] = {}
        if kind == "exploit":
            t0 = time.perf_counter()
            g = self.estimates.matrix([r.request_id for r in todo])
            for r, arm in zip(todo, max_weight_matching(g, [max(c, 0) for c in left])):
                out[r.request_id] = arm
            self.overhead_s["matching"] += time.perf_counter() - t0
            return out
        if kind == "prompt-length":
            todo = sorted(todo, key=lambda r: (len(r.prompt_token_ids), r.request_id))
        by_size = sorted(range(len(self.arms)), key=lambda j: (self._sizes[j], j))
        best = sorted(range(len(self.arms)), key=lambda j: (-self.estimates.arm_mean(j), j))
        for rank, r in enumerate(todo):
            if kind == "prompt-length":
                pref = by_size[rank * len(by_size) // len(todo):] + by_size[::-1]
            elif kind == "explore" or self.rng.random() < self.config.epsilon:
                pref = self.rng.sample(range(len(self.arms)), len(self.arms))
            else:
                pref = best
            out[r.request_id] = next((j for j in pref if left[j] > 0), -1)
            if out[r.request_id] >= 0:
                left[out[r.request_id]] -= 1
        return out

    # -- protocol --------------------------------------------------------------------------------
    def propose(self, requests: list) -> dict[str, DraftTree]:
        self._join()
        t0 = time.perf_counter()
        self._account_undrafted()
        if self._block_left == 0:
            self._block, self._block_left = self._upcoming
            self._upcoming = next(self._blocks)
            new = self._next if self._next is not None else self._decide(self._block, requests, {})
            self._switch(new)
            self._next = None
        ids = {r.request_id for r in requests}
        fixed = {rid: a for rid, a in self.assignment.items() if rid in ids}
        for rid, arm in self._decide(self._block, requests, fixed).items():  # newcomers
            self.assignment[rid] = arm
        self._block_left -= 1
        self.num_steps += 1
        self.overhead_s["bookkeeping"] += time.perf_counter() - t0
        out: dict[str, DraftTree] = {}
        for j, arm in enumerate(self.arms):
            batch = [r for r in requests if self.assignment.get(r.request_id) == j]
            if not batch:
                continue
            t1 = time.perf_counter()
            trees = arm.propose(batch)
            share = (time.perf_counter() - t1) / len(batch)
            for r in batch:
                self._pending[r.request_id] = (r, j, r.num_tokens, share, r.request_id in trees)
            out.update(trees)
        if self._block_left == 0:
            self._next = self._decide(self._upcoming[0], requests, {})
            if self.config.prepare_ahead:
                self._prepare_switches(requests)
        return out

    def observe(self, feedback: list[Feedback]) -> None:
        self._join()
        t0 = time.perf_counter()
        routed: dict[int, list[Feedback]] = {}
        for fb in feedback:
            entry = self._pending.pop(fb.request_id, None)
            if entry is None:
                continue
            _, arm, _, share, _ = entry
            self._stats[arm]["drafted"] += len(fb.tree)
            self._stats[arm]["accepted"] += fb.num_accepted
            self.estimates.add(fb.request_id, arm, fb.num_emitted, fb.verify_time + share)
            routed.setdefault(arm, []).append(fb)
        if feedback:
            self._verify_share = sum(fb.verify_time for fb in feedback) / len(feedback)
        for rid in self._dropped:
            self._pending.pop(rid, None)
            self.estimates.forget(rid)
        self._dropped.clear()
        self.overhead_s["bookkeeping"] += time.perf_counter() - t0
        for arm, fbs in routed.items():
            self.arms[arm].observe(fbs)

    def release(self, request_id: str) -> None:
        self._join()
        self.assignment.pop(request_id, None)
        if self._next is not None:
            self._next.pop(request_id, None)
        self._dropped.add(request_id)  # its last feedback may still arrive in this step's observe
        for arm in self.arms:
            arm.release(request_id)

    @property
    def num_speculative_tokens(self) -> int:
        """The deepest arm's length (arms are set together; an adaptive arm reports its own)."""
        return max((n for n in map(speculation_length, self.arms) if n is not None), default=0)

    def set_num_speculative_tokens(self, n: int) -> None:
        for arm in self.arms:
            set_speculation_length(arm, n)

    def state(self) -> dict:
        return {"weights": {k: round(v, 4) for k, v in self.weights.items()},
                "arm_goodput": {a.name: round(self.estimates.arm_mean(j), 2) for j, a in enumerate(self.arms)},
                "assigned": {a.name: sum(1 for v in self.assignment.values() if v == j) for j, a in enumerate(self.arms)},
                "overhead_s": {k: round(v, 6) for k, v in self.overhead_s.items()}}

    # -- internals -------------------------------------------------------------------------------
    def _account_undrafted(self) -> None:
        """Steps whose arm offered no draft get no feedback; they still cost a step for one token."""
        for rid, (req, arm, n0, share, drafted) in list(self._pending.items()):
            if drafted and rid not in self._dropped:
                continue  # its draft is still waiting for verification
            del self._pending[rid]
            gained = req.num_tokens - n0
            if not drafted and gained > 0 and self._verify_share is not None:
                self.estimates.add(rid, arm, gained, self._verify_share + share)

    def _switch(self, new: dict[str, int]) -> None:
        for rid, arm in new.items():
            old = self.assignment.get(rid, -1)
            if old >= 0 and old != arm:  # free the old draft's KV, unless the new arm shares that draft
                keep = {id(p) for p in leaves(self.arms[arm])} if arm >= 0 else set()
                for leaf in leaves(self.arms[old]):
                    if id(leaf) not in keep:
                        free_kv(leaf, rid)
            self.assignment[rid] = arm

    def _prepare_switches(self, requests: list) -> None:
        moves: dict[int, list] = {}
        for r in requests:
            arm = self._next.get(r.request_id, -1)
            if arm >= 0 and arm != self.assignment.get(r.request_id, -1):
                moves.setdefault(arm, []).append(r)
        if not moves:
            return
        if not self.config.prepare_in_thread:
            for arm, reqs in moves.items():
                prepare_kv(self.arms[arm], reqs)
            return
        snaps = {arm: [RequestSnapshot(r.request_id, list(r.all_token_ids), r.params, len(r.prompt_token_ids))
                        for r in reqs] for arm, reqs in moves.items()}

        def run() -> None:
            try:
                for arm, reqs in snaps.items():
                    prepare_kv(self.arms[arm], reqs)
            except BaseException as e:  # handed to the caller at the next join
                self._thread_error = e

        self._thread = threading.Thread(target=run, name="specfleet-prepare", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            err, self._thread_error = self._thread_error, None
            if err is not None:
                raise err
