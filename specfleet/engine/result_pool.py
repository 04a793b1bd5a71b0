"""Drafting decoupled from verification: the intermediate result pool, back-pressure, micro-batches.

Minions puts an *intermediate result pool* between the drafts and the target: drafters take
requests whose last verification is committed, draft them and put the trees into the pool; the
target takes a batch of ready drafts, verifies and commits. Back-pressure keeps unverified drafts
(and the draft KV behind them) from piling up: a drafter only starts on a request while

    len(pool) + drafts in flight < capacity        (capacity = the target's batch size)

so the pool never holds more than one target batch. SPIN's micro-batches fall out of the same rule:
with the target batch set to ceil(running / m), the running requests cycle through the pool as m
groups, and while the target verifies one group a drafter drafts the next (m = 2: A verifies while
B drafts, then B verifies while A drafts). `MicroBatchSearch` picks m as SPIN does: raise it while
measured throughput improves.

The pool is the only place engine and drafter threads meet. Everything that crosses (requests to
draft, drafted trees, the proposers' observe/release messages) goes through its one lock, in order,
so a drafter never sees a release before the submission it follows, nor after one it precedes.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from specfleet.errors import InvalidRequestError
from specfleet.core.tree import DraftTree

if TYPE_CHECKING:
    from specfleet.engine.request import Request


@dataclass(frozen=True)
class PipelineConfig:
    num_micro_batches: int | None = None  # SPIN's m; None = search for it while running
    max_micro_batches: int = 4  # the search never goes above this
    pool_capacity: int | None = None  # None = the target's batch size, ceil(active requests / m)
    search_window: int = 6  # target steps measured per candidate m
    search_min_gain: float = 0.03  # a larger m must beat the previous one by this fraction
    # CPU intra-op threads for the target (the thread that calls step()) and for each drafter thread;
    # None leaves PyTorch's setting alone. With the OpenMP backend the count is per thread.
    target_threads: int | None = None
    draft_threads: int | None = None

    def validate(self) -> None:
        for name in ("num_micro_batches", "pool_capacity", "target_threads", "draft_threads"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InvalidRequestError(f"pipeline {name} must be >= 1 or None, got {v}")
        if self.max_micro_batches < 1 or self.search_window < 1 or self.search_min_gain < 0:
            raise InvalidRequestError(f"invalid pipeline search settings {self}")


@dataclass
class PoolEntry:
    """A finished draft waiting for the target. `num_tokens` is the request's length when drafted:
    the draft is only valid if the request still has exactly that many tokens."""

    request: "Request"
    tree: DraftTree | None  # None: the drafter had nothing to offer; the target decodes one token
    num_tokens: int
    drafter: int
    draft_time: float  # this request's share of the drafting call, seconds
    error: Exception | None = None  # what propose() raised (tree None): the engine stops drafting for it


@dataclass
class Claim:
    messages: list[tuple[str, Any]]  # ("observe", [Feedback]) / ("release", request_id): sent before
    requests: list["Request"]  # these, to draft after applying the messages; each holds a pool slot


class PipelineFailed(RuntimeError):
    """A drafter thread raised; the engine re-raises it from step()."""


class ResultPool:
    def __init__(self, num_drafters: int, capacity: int = 1):
        self._cv = threading.Condition()
        self._inbox: list[deque[tuple[str, Any]]] = [deque() for _ in range(num_drafters)]
        self._ready: deque[PoolEntry] = deque()
        self._in_flight = 0
        self._capacity = capacity
        self._closed = False
        self._error: BaseException | None = None
        # metrics (under the lock)
        self.max_occupancy = 0  # most entries ever held (ready + in flight)
        self.max_capacity = capacity  # the bound max_occupancy is held to (capacity shrinks as requests end)
        self.occupancy_sum = self.num_occupancy_samples = 0  # drafts ready each time the target looked
        self.num_back_pressure_waits = 0  # times a drafter had work but had to wait for room
        self.draft_idle = [0.0] * num_drafters
        self.draft_busy = [0.0] * num_drafters

    # -- engine side -----------------------------------------------------------------------------
    def set_capacity(self, capacity: int) -> None:
        with self._cv:
            self._capacity = max(1, capacity)
            self.max_capacity = max(self.max_capacity, self._capacity)
            self._cv.notify_all()

    @property
    def capacity(self) -> int:
        return self._capacity

    def submit(self, drafter: int, request: "Request") -> None:
        """A request whose verification is committed, to be drafted by `drafter`."""
        self._send(drafter, ("draft", request))

    def notify(self, drafter: int, kind: str, payload: Any) -> None:
        """A proposer message ("observe" or "release"), delivered after everything sent before it."""
        self._send(drafter, (kind, payload))

    def _send(self, drafter: int, item: tuple[str, Any]) -> None:
        with self._cv:
            self._inbox[drafter].append(item)
            self._cv.notify_all()

    def withdraw(self, request_id: str) -> None:
        """Forget a finished request: drop its queued submission and its drafted entry, if any. A
        draft in flight comes back later and the engine discards it."""
        with self._cv:
            for box in self._inbox:
                for item in [i for i in box if i[0] == "draft" and i[1].request_id == request_id]:
                    box.remove(item)
            self._ready = deque(e for e in self._ready if e.request.request_id != request_id)
            self._cv.notify_all()

    @property
    def num_outstanding(self) -> int:
        """Requests somewhere between submission and take: queued, being drafted or drafted."""
        with self._cv:
            queued = sum(1 for box in self._inbox for kind, _ in box if kind == "draft")
            return queued + self._in_flight + len(self._ready)

    def take(self, max_n: int, wait_s: float = 0.0, sample: bool = True) -> list[PoolEntry]:
        """Up to `max_n` drafted entries, oldest first; waits up to `wait_s` for the first one.
        `sample` records the occupancy the target found (once per step, not per retry)."""
        with self._cv:
            self._cv.wait_for(lambda: self._ready or self._error or self._closed, timeout=wait_s)
            if self._error is not None:
                raise PipelineFailed(f"a drafter failed: {self._error!r}") from self._error
            if sample:
                self.occupancy_sum += len(self._ready)
                self.num_occupancy_samples += 1
            out = [self._ready.popleft() for _ in range(min(max_n, len(self._ready)))]
            if out:
                self._cv.notify_all()  # room for the drafters
            return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # -- drafter side ----------------------------------------------------------------------------
    def claim(self, drafter: int) -> Claim | None:
        """Block until there are messages for `drafter` or a request it may draft (back-pressure:
        only while the pool has room). Returns None once the pool is closed and the inbox drained."""
        box = self._inbox[drafter]
        t0 = time.perf_counter()
        waited_for_room = False
        with self._cv:
            while True:
                msgs: list[tuple[str, Any]] = []
                reqs: list["Request"] = []
                room = self._capacity - len(self._ready) - self._in_flight
                # a claim is the messages up to the first draft, then drafts while there is room: the
                # drafter applies messages first, so one sent after a draft must wait for the next claim
                while box:
                    if box[0][0] != "draft":
                        if reqs:
                            break
                        msgs.append(box.popleft())
                    elif self._closed:
                        box.popleft()  # no more drafting, but the releases behind it still count
                    elif len(reqs) < room:
                        reqs.append(box.popleft()[1])
                    else:
                        break
                if msgs or reqs:
                    break
                if self._closed:
                    return None
                if box and not waited_for_room:  # work is queued but the pool is full
                    waited_for_room = True
                    self.num_back_pressure_waits += 1
                self._cv.wait()
            self._in_flight += len(reqs)
            self.max_occupancy = max(self.max_occupancy, len(self._ready) + self._in_flight)
            self.draft_idle[drafter] += time.perf_counter() - t0
        return Claim(msgs, reqs)

    def put(self, drafter: int, entries: list[PoolEntry], busy_s: float) -> None:
        with self._cv:
            self._in_flight -= len(entries)
            self._ready.extend(entries)
            self.draft_busy[drafter] += busy_s
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify_all()


# -- choosing m (SPIN) ---------------------------------------------------------------------------
def next_micro_batches(history: dict[int, float], m: int, max_m: int, min_gain: float) -> tuple[int, bool]:
    """Given measured throughput per m (m just measured), the next m to try and whether to stop.

    Raise m while it pays by more than `min_gain`; stop at the first m that does not, or at max_m,
    and settle on the best m seen. Example: {1: 10, 2: 14} -> try 3; {1: 10, 2: 14, 3: 13} -> 2.
    """
    improved = m == 1 or history[m] > history[m - 1] * (1 + min_gain)
    if improved and m < max_m:
        return m + 1, False
    return max(history, key=lambda k: (history[k], -k)), True


def search_micro_batches(throughput_of: Callable[[int], float], max_m: int, min_gain: float = 0.03) -> int:
    """SPIN's offline variant: the same search over profiled (or modelled) throughput."""
    history: dict[int, float] = {}
    m, done = 1, False
    while not done:
        history[m] = throughput_of(m)
        m, done = next_micro_batches(history, m, max_m, min_gain)
    return m


class MicroBatchSearch:
    """The online variant: measure emitted tokens per second over `window` target steps for each m
    (skipping the first step after a change, while the pool refills), then move on or settle."""

    def __init__(self, max_m: int, window: int, min_gain: float, fixed: int | None = None):
        self.m = fixed or 1
        self.is_settled = fixed is not None
        self.history: dict[int, float] = {}
        self._max_m, self._window, self._min_gain = max_m, window, min_gain
        self._steps = self._tokens = 0
        self._seconds = 0.0

    def record(self, num_tokens: int, seconds: float) -> None:
        if self.is_settled:
            return
        self._steps += 1
        if self._steps == 1:
            return  # warm-up step of this m
        self._tokens += num_tokens
        self._seconds += seconds
        if self._steps <= self._window:
            return
        self.history[self.m] = self._tokens / max(self._seconds, 1e-9)
        self.m, self.is_settled = next_micro_batches(self.history, self.m, self._max_m, self._min_gain)
        self._steps = self._tokens = 0
        self._seconds = 0.0


def target_batch_size(num_active: int, m: int) -> int:
    return max(1, math.ceil(num_active / m))


@dataclass
class TargetClock:
    """The target's side of the metrics: busy (forward, verify, commit) and idle (waiting for drafts)."""

    num_steps: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    num_emitted: int = 0
    first_step: float | None = None
    last_step: float | None = None
    num_verified: int = 0  # drafted requests taken from the pool, over all steps


def pipeline_stats(clock: TargetClock, pool: ResultPool, search: MicroBatchSearch) -> dict:
    steps = max(1, clock.num_steps)
    wall = (clock.last_step - clock.first_step) if clock.first_step is not None else 0.0
    draft_idle = sum(pool.draft_idle)
    return {
        "steps": clock.num_steps,
        "wall_s": wall,
        "throughput_tok_s": clock.num_emitted / wall if wall > 0 else 0.0,
        "target_busy_s": clock.busy_s,
        "target_idle_s": clock.idle_s,
        "target_idle_per_step_s": clock.idle_s / steps,
        "target_idle_fraction": clock.idle_s / max(clock.idle_s + clock.busy_s, 1e-9),
        "draft_busy_s": list(pool.draft_busy),
        "draft_idle_s": list(pool.draft_idle),
        "draft_idle_per_step_s": draft_idle / steps / max(1, len(pool.draft_idle)),
        "pool_capacity": pool.max_capacity,
        "pool_occupancy_max": pool.max_occupancy,
        "pool_occupancy_mean": pool.occupancy_sum / max(1, pool.num_occupancy_samples),
        "back_pressure_waits": pool.num_back_pressure_waits,
        "mean_target_batch": clock.num_verified / steps,
        "num_micro_batches": search.m,
        "micro_batch_search": {"settled": search.is_settled, "throughput_by_m": dict(search.history)},
    }
