"""Minions' adaptive speculation length: a controller around any proposer.

The speculation length s trades draft work and verification cost against tokens kept per step; the
best s moves with the batch size, the data and the draft. An online monitor records, per step, the
step's cost and its verified length (tokens committed); its statistic is y = cost / verified tokens,
the time per emitted token (Minions' t_LLM / vl). Once at least `decision_threshold` observations
have arrived since the last change, a least-squares line is fitted to y over the observations of the
previous length followed by those of the current one:

- rising slope: the last change made tokens dearer; it overshot, so move back (by `punish_step`);
- falling (or flat) slope: the last change paid off, so continue in the same direction (by
  `reward_step`); a flat first window therefore probes upwards.

Minions applies the rule after increases (rising -> decrease, falling -> increase); we also apply it
after decreases, as hill climbing, so the controller can walk down to 0 when speculation does not
pay (large batches, a poor draft) and back up when it does again. At 0 the inner proposer is not
called at all: plain decoding. When a move is blocked by a bound, the direction is still remembered,
so a later rising trend (conditions changed) turns the controller back inwards, and after
`probe_every` blocked decisions it steps inwards once to re-measure. A rise smaller than
`flat_tolerance` of the window's mean counts as flat, so noise does not turn the controller around
where neighbouring lengths cost the same.

Adaptation to this engine: Minions pipelines drafting behind verification, so t_LLM alone is its
cost. Here drafting may run on the critical path between verifications, so the cost is wall time
between a request's consecutive drafts (draft + verify + bookkeeping), summed over the requests of
a `propose` call and divided by the tokens they gained (y = time per token per request, which at a
steady batch size is proportional to 1 / throughput). That also makes s = 0 measurable, where there
is no draft to be given feedback about.

The fit weights each observation by the tokens it verified (`fit_weights="tokens"`, the default):
at batch 1 the per-step y swings by the number of drafted tokens that happened to be accepted, and
weighted least squares turns the window's comparison into one of time over tokens (ratio of sums)
rather than a mean of ratios that a single 1-token step drags up. `fit_weights="none"` is Minions'
plain fit.

Worked example (decision_threshold 3, unit weights, s = 4 after an increase from 3): y at s=3 was [10, 10, 10] ms,
at s=4 [12, 12, 12]: the fit rises, so s goes back to 3 and the next move's direction is "down"; if
y at s=3 is then [9, 9, 9] the fit over [12 x3, 9 x3] falls, so the controller continues down to 2.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from specfleet.errors import InvalidRequestError
from specfleet.core.proposer import DraftStats, DraftWeights, Feedback, Proposer, prepare_kv, set_speculation_length
from specfleet.core.tree import DraftTree


@dataclass(frozen=True)
class LengthConfig:
    initial_length: int = -1  # -1: start at the spec's num_speculative_tokens
    min_length: int = 0  # 0 allows turning speculation off entirely
    max_length: int = 8
    decision_threshold: int = 8  # observations since the last change before the next decision
    reward_step: int = 1  # Minions' s_reward: how far to continue after a change that paid off
    punish_step: int = 1  # Minions' s_punish: how far to move back after a change that overshot
    # a fitted rise of y across the window below this fraction of mean(y) is not taken as overshooting
    # (0 = any rise is, as in Minions). Where neighbouring lengths cost about the same per token (on a
    # CPU, bf16 verification of s+1 tokens costs nearly s+1 steps, so s = 1..4 all lose about equally),
    # an exact rule reverses on noise about half the time and random-walks instead of crossing the flat
    # stretch; 5 % is above the window-to-window noise measured at batch 1
    flat_tolerance: float = 0.05
    # after this many decisions in a row that would move past a bound, step inwards once to re-measure
    # (conditions change: a batch shrinks, the text turns predictable); 0 = stay at the bound
    probe_every: int = 8
    # "tokens": each observation's y is weighted by the tokens it verified in the fit (weighted least
    # squares), so the line follows time per token over the window rather than the mean of per-step
    # ratios, whose spread at batch 1 comes mostly from how many drafted tokens happened to be accepted
    # (a step that keeps 1 token has 5x the y of one that keeps 5); "none": every step counts alike
    fit_weights: str = "tokens"

    def validate(self) -> None:
        if not 0 <= self.min_length <= self.max_length:
            raise InvalidRequestError(f"adaptive length: need 0 <= min_length <= max_length, got "
                                      f"{self.min_length}, {self.max_length}")
        if self.initial_length < -1:
            raise InvalidRequestError(f"adaptive length: initial_length must be >= 0 (or -1 for the spec's "
                                      f"length), got {self.initial_length}")
        if self.decision_threshold < 2:
            raise InvalidRequestError("adaptive length: decision_threshold must be >= 2 (a line needs two points)")
        if self.fit_weights not in ("tokens", "none"):
            raise InvalidRequestError(f"adaptive length: fit_weights must be 'tokens' or 'none', got {self.fit_weights!r}")
        if self.reward_step < 1 or self.punish_step < 1 or self.flat_tolerance < 0 or self.probe_every < 0:
            raise InvalidRequestError("adaptive length: reward_step and punish_step must be >= 1, "
                                      "flat_tolerance and probe_every >= 0")


def prune_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """The nodes at depth <= max_depth (closed under ancestors, so still a valid tree)."""
    depths = tree.depths()
    return tree.subtree([j for j, d in enumerate(depths) if d <= max_depth])


def fitted_slope(ys: list[float], ws: list[float] | None = None) -> float:
    """(Weighted) least-squares slope of ys against 0, 1, 2, ..."""
    n = len(ys)
    ws = [1.0] * n if ws is None else ws
    total = sum(ws)
    if n < 2 or total <= 0:
        return 0.0
    mx = sum(w * x for x, w in enumerate(ws)) / total
    my = sum(w * y for y, w in zip(ys, ws)) / total
    sxx = sum(w * (x - mx) ** 2 for x, w in enumerate(ws))
    return sum(w * (x - mx) * (y - my) for x, (y, w) in enumerate(zip(ys, ws))) / sxx if sxx else 0.0


class LengthMonitor:
    """The pure decision rule (no clocks): feed observations, read `length`."""

    def __init__(self, config: LengthConfig, initial: int):
        config.validate()
        self.config = config
        self.length = min(max(initial, config.min_length), config.max_length)
        self.direction = +1  # the last move; the start counts as an increase, as in Minions
        self.previous: list[tuple[float, float]] = []  # (y, weight) at the length before the last decision
        self.current: list[tuple[float, float]] = []  # (y, weight) since the last decision
        self.history: list[tuple[int, int]] = []  # (observation count, new length) per decision
        self.num_observations = 0
        self.blocked = 0  # decisions in a row that a bound stopped

    def record(self, y: float, tokens: float = 1.0) -> bool:
        """One step's time per verified token (`tokens` verified); True when this changed the length."""
        self.current.append((y, tokens if self.config.fit_weights == "tokens" else 1.0))
        self.num_observations += 1
        if len(self.current) < self.config.decision_threshold:
            return False
        window = self.previous[-self.config.decision_threshold:] + self.current
        ys, ws = [y for y, _ in window], [w for _, w in window]
        rise = fitted_slope(ys, ws) * (len(window) - 1)  # the fitted change of y across the window
        mean_y = sum(y * w for y, w in window) / sum(ws)
        old = self.length
        if rise > self.config.flat_tolerance * mean_y:  # overshot: move back
            self.direction = -self.direction
            step = self.config.punish_step
        else:  # falling (or flat: keep probing in the same direction)
            step = self.config.reward_step
        self.length = min(max(old + self.direction * step, self.config.min_length), self.config.max_length)
        self.blocked = self.blocked + 1 if self.length == old else 0
        if self.config.probe_every and self.blocked >= self.config.probe_every:  # probe inwards once
            self.direction = -self.direction
            self.length = min(max(old + self.direction * step, self.config.min_length), self.config.max_length)
            self.blocked = 0
        self.previous, self.current = self.current, []
        if self.length != old:
            self.history.append((self.num_observations, self.length))
        return self.length != old


class LengthController:
    """A proposer that drafts through `inner` at the length the monitor chooses."""

    def __init__(self, inner: Proposer, config: LengthConfig | None = None, initial: int = 4):
        self.inner = inner
        self.children = [inner]
        self._engine_now: float | None = None  # the engine's clock once it reports steps (observe_step)
        self.config = config or LengthConfig()
        self.monitor = LengthMonitor(self.config, initial if self.config.initial_length < 0 else self.config.initial_length)
        self.name = f"{inner.name}+adaptive"
        self._can_set = set_speculation_length(inner, max(self.monitor.length, 1))
        self._seen: dict[str, tuple[float, int]] = {}  # request id -> (time of its last draft, num_tokens)
        self.overhead_s = {"fit": 0.0}

    @property
    def length(self) -> int:
        return self.monitor.length

    @property
    def num_speculative_tokens(self) -> int:
        """The current adaptive length (0: speculation is off for now)."""
        return self.monitor.length

    @property
    def weights(self) -> dict:
        return dict(self.inner.weights) if isinstance(self.inner, DraftWeights) else {}

    @property
    def draft_stats(self) -> dict:
        return dict(self.inner.draft_stats) if isinstance(self.inner, DraftStats) else {}

    def state(self) -> dict:
        info = {"length": self.length, "overhead_s": {k: round(v, 6) for k, v in self.overhead_s.items()}}
        if self.weights:
            info["weights"] = {k: round(v, 4) for k, v in self.weights.items()}
        return info

    def _observe_step(self, requests: list, now: float) -> None:
        """y since these requests' previous drafts: wall time over the tokens they gained. Per request
        (not per call), so it also holds when a pipelined drafter drafts micro-batches in turn."""
        t0 = time.perf_counter()
        elapsed, gained = 0.0, 0
        for r in requests:
            last = self._seen.get(r.request_id)
            if last is not None:
                elapsed += now - last[0]
                gained += r.num_tokens - last[1]
            self._seen[r.request_id] = (now, r.num_tokens)
        if gained > 0 and self.monitor.record(elapsed / gained, gained) and self.monitor.length > 0:
            set_speculation_length(self.inner, self.monitor.length)
        self.overhead_s["fit"] += time.perf_counter() - t0

    def observe_step(self, timing) -> None:
        """The engine's clock (core/proposer.StepTiming): the time from the previous drafting's start to this
        one's, added to a clock that only the engine advances."""
        if self._engine_now is None:  # from here on: the same base as the times already kept, then durations
            self._engine_now = time.perf_counter()
        else:
            self._engine_now += timing.draft_seconds + timing.seconds

    def propose(self, requests: list) -> dict[str, DraftTree]:
        self._observe_step(requests, self._engine_now if self._engine_now is not None else time.perf_counter())
        s = self.monitor.length
        if s == 0:
            return {}
        trees = self.inner.propose(requests)
        if not self._can_set:  # the inner proposer ignores lengths: cut its trees instead
            trees = {rid: prune_depth(t, s) for rid, t in trees.items()}
        return trees

    def observe(self, feedback: list[Feedback]) -> None:
        self.inner.observe(feedback)

    def release(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
        self.inner.release(request_id)

    def set_num_speculative_tokens(self, n: int) -> None:
        """An outer controller (or the user) resets the length; learning continues from there."""
        self.monitor.length = min(max(n, self.config.min_length), self.config.max_length)
        if self.monitor.length > 0:
            set_speculation_length(self.inner, self.monitor.length)

    def prepare(self, requests: list) -> None:
        prepare_kv(self.inner, requests)
