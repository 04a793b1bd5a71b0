"""Online estimates of what speculation costs and gains, for the fleet's per-step decisions.

Four estimators, all fed from timings and outcomes the fleet observes itself:

- `StepCosts`: T(B, N), the wall time of one engine step (target forward, verification, commit,
  bookkeeping) with B requests decoding and N draft nodes verified in total. Per batch size it keeps a
  running mean per N, made non-decreasing in N (pool-adjacent-violators) and interpolated between the
  N it has seen (once two N were timed `min_support` times, only the N timed that often); beyond them it
  extends with the steeper of the last segment's slope and the slope of a least-squares fit
  T = a + b*B + g*N over recent steps (which also answers for an unseen B). With
  no timing at all it answers in *step units*: T = B + prior_node_cost * N. Below the fewest nodes seen
  at a batch size (one that always speculated, so its plain step was never timed) it extends down with the
  steeper of the first segment's slope and the fit's: erring low there makes plain decoding look cheap, so
  the fleet decodes plain and times the plain step, where erring high (as a floor at half the step did) made
  every node look cheap beside an overestimated share and the plain step was never timed. A request's share of a
  plain step is T(B, 0) / B; the cost of verifying n more nodes is T(B, N + n) - T(B, N). In units of
  one plain decode step, c(n) = T(1, n) / T(1, 0).
- `DraftCost`: one draft's time per request per call, fitted as a + b*k + g*gap (k tokens asked for,
  gap = committed tokens its cache had to catch up on), and its d = seconds per drafted node.
- `Acceptance`: for one draft, P(a node is accepted | its parent was) per (context, depth, sibling
  rank), a Beta posterior with forgetting; a context cell with few observations is shrunk towards
  the pooled (depth, rank) estimate. The probability that a node lies on the accepted path is the
  product along its path, and E[tokens of a step] = 1 + the sum of those over the verified nodes
  (the target always adds one token), so for a fixed node count the best subtree is the nodes of
  highest path probability (closed under ancestors, since a child's never exceeds its parent's).
- `AnswerLengths`: how many more tokens a request will likely generate, from the lengths of the answers
  that finished before it, where its max_tokens says only how many it may.

Worked example (chain, context 0, depths 1..3 with conditional acceptance .9, .8, .5): path
probabilities .9, .72, .36, so E[tokens] at 0..3 nodes is 1, 1.9, 2.62, 2.98; with T(1, n) = 10 +
2n ms the rates are .100, .158, .187, .186 tokens/ms: verify 2 nodes.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from specfleet.core.tree import DraftTree


class LinearFit:
    """Least squares y ~ x . theta over the last `window` observations (minimum-norm when a feature
    never varied, so predictions along the observed data stay right); with `select`, over the observations it
    keeps of them (asked again after each new observation)."""

    def __init__(self, window: int = 256, select=None):
        self.rows: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.select = select
        self._kept: list | None = None  # the selected rows, until the next observation
        self._theta: np.ndarray | None = None
        self._varied: dict[int, bool] = {}  # answers of `varied`, until the next observation

    def add(self, x: tuple[float, ...], y: float) -> None:
        self.rows.append((tuple(float(v) for v in x), float(y)))
        self._kept, self._theta = None, None
        self._varied.clear()

    def _rows(self) -> list:
        if self._kept is None:
            self._kept = list(self.rows) if self.select is None else self.select(self.rows)
        return self._kept

    @property
    def theta(self) -> np.ndarray | None:
        rows = self._rows()
        if self._theta is None and rows:
            xs = np.array([x for x, _ in rows])
            ys = np.array([y for _, y in rows])
            self._theta = np.linalg.lstsq(xs, ys, rcond=None)[0]
        return self._theta

    def predict(self, x: tuple[float, ...]) -> float | None:
        theta = self.theta
        return None if theta is None else float(np.dot(theta, x))

    def varied(self, feature: int) -> bool:
        """Whether `feature` took at least two values among the kept observations."""
        if feature not in self._varied:
            self._varied[feature] = len({x[feature] for x, _ in self._rows()}) > 1
        return self._varied[feature]


def pool_adjacent_violators(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in weighted least squares."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [b[0] for b in blocks for _ in range(b[2])]


class StepCosts:
    def __init__(self, window: int = 256, cell_memory: int = 32, prior_node_cost: float = 0.1, min_support: int = 4):
        # like the curve (_curve), the fit leaves out node counts timed too few times (_counted): one slow first
        # verification (3.3 plain steps for 2 nodes, batch 1, Zen 4) had made its slope 1.1 plain steps a node,
        # beyond every count the curve knew, long after the cells had forgotten it
        self.fit = LinearFit(window, select=self._counted_rows)
        self.cell_memory = cell_memory  # a cell's mean follows roughly its last this many steps
        self.prior_node_cost = prior_node_cost
        # once two node counts were timed this often, a count timed fewer times is left out of the curve (_curve)
        self.min_support = min_support
        self.cells: dict[int, dict[int, list[float]]] = {}  # batch -> nodes -> [mean seconds, count]
        self._curves: dict[int, tuple[list[int], list[float]]] = {}
        self._memo: dict[tuple[int, int], float] = {}  # step_time answers, until the next step is added
        self.num_observations = 0

    @property
    def measured(self) -> bool:
        return self.num_observations > 0

    def add(self, batch: int, nodes: int, seconds: float) -> None:
        cell = self.cells.setdefault(batch, {}).setdefault(nodes, [0.0, 0])
        cell[1] += 1
        cell[0] += (seconds - cell[0]) / min(cell[1], self.cell_memory)
        self.fit.add((1.0, batch, nodes), seconds)
        self._curves.pop(batch, None)
        self._memo.clear()
        self.num_observations += 1

    def _counted(self, batch: int) -> set[int]:
        """The node counts at `batch` that curves and fits are made from: once two were timed `min_support` times,
        those timed that often; before that every count seen, as the first steps must decide from something."""
        cells = self.cells.get(batch, {})
        often = {n for n, c in cells.items() if c[1] >= self.min_support}
        return often if len(often) >= 2 else set(cells)

    def _counted_rows(self, rows) -> list:
        """The fit's observations (1, batch, nodes) -> seconds whose node count counts at their batch size."""
        counted: dict[int, set[int]] = {}
        out = []
        for x, y in rows:
            batch = int(x[1])
            if batch not in counted:
                counted[batch] = self._counted(batch)
            if int(x[2]) in counted[batch]:
                out.append((x, y))
        return out

    def _curve(self, batch: int) -> tuple[list[int], list[float]]:
        """The per-N means, made non-decreasing. Once two node counts were timed at least min_support times,
        a count timed fewer times is left to the curve's neighbours and the fit: one stray slow step at the
        largest count seen (a verification the OS descheduled) had priced that count and, by the last
        segment's slope, every larger tree, so the fleet never verified one again to correct it (a chat
        run's c(4) read 3.2 where its steps cost 1.5). Before that every count seen counts, as the first
        steps must decide from something."""
        if batch not in self._curves:
            counted = self._counted(batch)
            cells = [(n, c) for n, c in sorted(self.cells[batch].items()) if n in counted]
            xs = [n for n, _ in cells]
            self._curves[batch] = (xs, pool_adjacent_violators([c[0] for _, c in cells], [c[1] for _, c in cells]))
        return self._curves[batch]

    def _fit_slope(self) -> float | None:
        theta = self.fit.theta
        return max(float(theta[2]), 0.0) if theta is not None and self.fit.varied(2) else None

    def step_time(self, batch: int, nodes: int) -> float:
        """Estimated seconds of a step (step units while nothing has been measured)."""
        if not self.measured:
            return batch + self.prior_node_cost * nodes
        key = (batch, nodes)
        if key not in self._memo:  # asked for the same few sizes many times per step
            self._memo[key] = self._step_time(batch, nodes)
        return self._memo[key]

    def _step_time(self, batch: int, nodes: int) -> float:
        if batch not in self.cells:
            pred = self.fit.predict((1.0, batch, nodes))
            base = self.fit.predict((1.0, batch, 0))
            if pred is None or base is None or base <= 0:  # extrapolating to a batch never seen: scale
                near = min(self.cells, key=lambda b: abs(b - batch))
                return self._step_time(near, nodes) * batch / near
            return max(pred, base)
        xs, ys = self._curve(batch)
        fitted = self._fit_slope()
        if nodes <= xs[0]:  # below the fewest nodes seen (a batch size that always speculated): steeply down
            slope = fitted if fitted is not None else self.prior_node_cost * ys[0] / batch
            if len(xs) > 1:
                slope = max(slope, (ys[1] - ys[0]) / (xs[1] - xs[0]))
            return max(ys[0] - slope * (xs[0] - nodes), 0.1 * ys[0])
        if nodes >= xs[-1]:
            local = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            slope = max(local, fitted if fitted is not None else self.prior_node_cost * ys[0] / batch)
            return ys[-1] + slope * (nodes - xs[-1])
        i = next(i for i, x in enumerate(xs) if x >= nodes)
        if xs[i] == nodes:
            return ys[i]
        f = (nodes - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + f * (ys[i] - ys[i - 1])

    def plain_samples(self, batch: int) -> int:
        """How many plain steps (no node verified) were timed at this batch size."""
        cell = self.cells.get(batch, {}).get(0)
        return 0 if cell is None else cell[1]

    def share(self, batch: int) -> float:
        """One request's share of a plain step at this batch size."""
        return self.step_time(batch, 0) / batch

    def marginal(self, batch: int, planned: int, nodes: int) -> float:
        """Extra time of verifying `nodes` more when `planned` nodes are already in the step."""
        if nodes <= 0:
            return 0.0
        return max(self.step_time(batch, planned + nodes) - self.step_time(batch, planned), 0.0)

    def c(self, max_nodes: int, batch: int = 1) -> list[float]:
        """[c(0), ..., c(max_nodes)] in plain steps at `batch` (one request's tree, the rest plain)."""
        base = self.step_time(batch, 0)
        return [self.step_time(batch, n) / base for n in range(max_nodes + 1)]


class DraftCost:
    """One draft's measured cost per request and call.

    The first call warms the draft (a model's weights and caches touched for the first time) and is dearer than
    the rest: the 0.5B's first 4-token chain took 109 ms against ~76 ms after. It stands alone until a second
    call is timed, which then replaces it; a cold first call that stayed in the mean made a draft that pays look
    as if it did not, and a fleet that never calls a draft again never re-times it."""

    def __init__(self, window: int = 128):
        self.window = window
        self.fit = LinearFit(window)
        self.seconds = 0.0
        self.nodes = 0
        self.calls = 0
        self.requests = 0
        self.warm = False  # whether the first (cold) call has been replaced

    def add(self, seconds: float, num_requests: int, k: int, gap: float, nodes: int) -> None:
        if self.calls == 1 and not self.warm:  # the second call: forget the cold first
            self.__init__(self.window)
            self.warm = True
        self.seconds += seconds
        self.nodes += nodes
        self.calls += 1
        self.requests += num_requests
        self.fit.add((1.0, k, gap), seconds / max(num_requests, 1))

    @property
    def measured(self) -> bool:
        return self.calls > 0

    @property
    def d(self) -> float:
        """Seconds per drafted node (0 before any node was drafted)."""
        return self.seconds / self.nodes if self.nodes else 0.0

    def per_request(self, k: int, gap: float) -> float:
        """Expected seconds of drafting `k` tokens for one request `gap` tokens behind (0 if unmeasured)."""
        if not self.measured:
            return 0.0
        mean = self.seconds / self.requests
        pred = self.fit.predict((1.0, k, gap))
        if pred is None or not (self.fit.varied(1) or self.fit.varied(2)):
            return mean
        return max(pred, 0.1 * mean)


class CatchUpCost:
    """Seconds a draft model takes per token to catch its cache up (a prompt, or a long absence)."""

    def __init__(self):
        self.total_s = 0.0
        self.tokens = 0

    def add(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self.total_s += seconds
            self.tokens += tokens

    @property
    def per_token(self) -> float:
        return self.total_s / self.tokens if self.tokens else 0.0

    def seconds(self, tokens: int) -> float:
        """Expected seconds to catch up `tokens` tokens (0 before any catch-up was timed)."""
        return self.per_token * max(tokens, 0)


class AnswerLengths:
    """How many more tokens a request will likely generate, learned from the answers of the requests that
    finished before it (the last `window`): its max_tokens says only how many it may, and a server request
    without one may run to the end of the context. An investment priced against the tokens a request has left
    (a draft model's prompt feed, spread over the steps that repay it) is judged against this horizon.

    A finished request is recorded with its answer's length L and whether max_tokens cut it (then L says only
    that answers go at least that far). For a request that has generated n tokens and may generate `left` more,
    the expected remaining is E[L - n | L > n] over the records: each answer longer than n contributes what it
    had left, L - n, or `left` if it was cut (it might have gone on to this request's cap); capped at `left`.
    Answers that ended by n say nothing about this request beyond that it is still going. With fewer than
    `min_samples` informative records (answers that ended, or cut ones longer than n) a prior answer of `prior`
    tokens stands in (0: the cap stands): prior - n, or n once past half of it. A request longer than every
    recorded answer is expected to go on about as long as it has run. Never more than the cap.

    Worked example: four BFCL tool calls ended at 18, 20, 22 and 24 tokens of their 64; a fifth, 2 tokens in,
    has 62 it may generate and an expected 19 (the mean of 16, 18, 20, 22); at 21 tokens, 2 (only the 22 and
    24 go on: 1 and 3). A warm-up cut at 16 of 16 leaves a HumanEval request at 30 of 128 its 98. Before any of
    that, a request without max_tokens (32k left) expects the prior's 256 tokens."""

    def __init__(self, window: int = 64, min_samples: int = 4, prior: int = 256):
        self.window = window
        self.min_samples = min_samples
        self.prior = prior
        self._done: dict[str, tuple[int, bool]] = {}  # request id -> (answer length, cut by max_tokens), oldest first

    def finish(self, request_id: str, length: int, cut: bool) -> None:
        if self.window <= 0:
            return
        self._done.pop(request_id, None)
        self._done[request_id] = (length, cut)
        while len(self._done) > self.window:
            del self._done[next(iter(self._done))]

    def forget(self, request_id: str) -> None:
        """The request runs again (it was preempted, not finished): its record was no answer."""
        self._done.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._done)

    def remaining(self, generated: int, left: int) -> float:
        """Expected tokens a request with `generated` tokens and `left` more allowed will still generate."""
        left = max(1, left)
        if self.window <= 0:
            return float(left)
        longer, ended = [], 0
        for length, cut in self._done.values():
            if length > generated:
                longer.append(left if cut else length - generated)
            elif not cut:
                ended += 1
        if len(longer) + ended < self.min_samples:
            return float(min(left, max(self.prior - generated, generated, 1))) if self.prior > 0 else float(left)
        if not longer:
            return float(min(left, max(1, generated)))
        return min(float(left), max(1.0, sum(longer) / len(longer)))


class Acceptance:
    """Conditional acceptance of a draft's nodes, per context, depth and sibling rank (decayed counts).

    A cell's estimate shrinks towards the pooled one over contexts (`shrink` pseudo-observations), and the
    pooled estimate of a depth shrinks towards the pooled estimate one level up (the prior's weight in
    pseudo-observations; depth 1 towards the prior's mean). A depth never observed therefore reads like the
    depth above it, not like the flat prior: with a flat 0.5 below depth 1, a fleet that had seen the 0.5B
    accept 0.78 of its first tokens expected ~2.2 tokens from a 4-deep chain, never called it deeper than one
    token, and so never learned that its deeper tokens are accepted as often (HumanEval, the 1.5B target: the
    0.5B was called on 0 of 251 steps beside the datastore; benchmarks/RESULTS.md, session 31). Conditional
    acceptance of a model's or a lookup's chain rarely falls with depth, so the level above is the better guess."""

    def __init__(self, prior: tuple[float, float] = (1.0, 1.0), shrink: float = 2.0, decay: float = 0.99,
                 max_depth: int = 16, max_rank: int = 4, num_contexts: int = 5):
        self.prior, self.shrink, self.decay = prior, shrink, decay
        self.max_depth, self.max_rank, self.num_contexts = max_depth, max_rank, num_contexts
        shape = (num_contexts, max_depth, max_rank, 2)  # [..., 0] = accepted (decayed), [..., 1] = tried
        self.counts = np.zeros(shape)
        self.pooled = np.zeros(shape[1:])
        self._pooled_p: np.ndarray | None = None  # pooled estimates per (depth, rank), rebuilt after an add

    def _cell(self, ctx: int, depth: int, rank: int) -> tuple[int, int, int]:
        return min(ctx, self.num_contexts - 1), min(depth, self.max_depth) - 1, min(rank, self.max_rank - 1)

    def add(self, ctx: int, depth: int, rank: int, accepted: bool) -> None:
        c, d, r = self._cell(ctx, depth, rank)
        for table in (self.counts[c, d, r], self.pooled[d, r]):
            table *= self.decay
            table += (float(accepted), 1.0)
        self._pooled_p = None

    def pooled_p(self) -> np.ndarray:
        """[max_depth, max_rank]: the pooled estimate of every cell, each depth shrunk towards the one above."""
        if self._pooled_p is None:
            a0, b0 = self.prior
            weight = a0 + b0
            out = np.empty(self.pooled.shape[:2])
            above = np.full(self.max_rank, a0 / weight)
            for d in range(self.max_depth):
                s, n = self.pooled[d, :, 0], self.pooled[d, :, 1]
                out[d] = above = (s + weight * above) / (n + weight)
            self._pooled_p = out
        return self._pooled_p

    def p(self, ctx: int, depth: int, rank: int) -> float:
        c, d, r = self._cell(ctx, depth, rank)
        pooled = self.pooled_p()[d, r]
        s, n = self.counts[c, d, r]
        return float((s + self.shrink * pooled) / (n + self.shrink))

    def upper(self, ctx: int, depth: int, rank: int, bonus: float) -> float:
        """An optimistic estimate: p plus `bonus` standard errors, the error from the (decayed) observations of
        this depth and rank over all contexts and the prior's pseudo-observations (at most 1)."""
        p = self.p(ctx, depth, rank)
        if bonus <= 0:
            return p
        _, d, r = self._cell(ctx, depth, rank)
        n = self.pooled[d, r, 1] + sum(self.prior)
        return float(min(1.0, p + bonus * np.sqrt(p * (1.0 - p) / n)))

    def path_probs(self, tree: DraftTree, ctx: int) -> list[float]:
        """P(node is on the accepted path) for every node of `tree`."""
        out: list[float] = []
        depths = tree.depths()
        for j, (parent, rank) in enumerate(zip(tree.parents, sibling_ranks(tree))):
            out.append((out[parent] if parent >= 0 else 1.0) * self.p(ctx, depths[j], rank))
        return out

    def tried(self, ctx: int, depth: int, rank: int = 0) -> float:
        """How often (decayed) a node at `depth` and `rank` was observed in context `ctx`."""
        return float(self.counts[self._cell(ctx, depth, rank)][1])

    def by_position(self, ctx: int | None = None, depth: int = 8) -> list[float]:
        """Conditional acceptance of the first child per depth (pooled over contexts unless `ctx`)."""
        if ctx is None:
            return [float(v) for v in self.pooled_p()[:min(depth, self.max_depth), 0]]
        return [self.p(ctx, d, 0) for d in range(1, depth + 1)]


def sibling_ranks(tree: DraftTree) -> list[int]:
    """Each node's index among its parent's children (0 = the first child)."""
    seen: dict[int, int] = {}
    ranks = []
    for p in tree.parents:
        ranks.append(seen.get(p, 0))
        seen[p] = ranks[-1] + 1
    return ranks


def outcomes(tree: DraftTree, accepted: set[int], observed_depth: int) -> list[tuple[int, int, bool]]:
    """(depth, rank, accepted) of every node whose parent was reached, down to `observed_depth`."""
    depths = tree.depths()
    out = []
    for j, (parent, rank) in enumerate(zip(tree.parents, sibling_ranks(tree))):
        if depths[j] <= observed_depth and (parent < 0 or parent in accepted):
            out.append((depths[j], rank, j in accepted))
    return out


def matched_nodes(tree: DraftTree, new_tokens: list[int]) -> set[int]:
    """Nodes whose path spells a prefix of `new_tokens`: for point-mass drafts, exactly the nodes
    verification accepts (the token emitted at a row is the accepted child's, if there is one)."""
    depths = tree.depths()
    hit: set[int] = set()
    for j, (parent, tok) in enumerate(zip(tree.parents, tree.token_ids)):
        d = depths[j]
        if d <= len(new_tokens) and new_tokens[d - 1] == tok and (parent < 0 or parent in hit):
            hit.add(j)
    return hit
