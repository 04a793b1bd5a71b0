"""A fleet of drafts that decides per step and per request from measured costs.

Speed-up = E[tokens per step] / (c(k) + k*d): weightless drafts (prompt lookup, n-gram, suffix) cost
d ~ 0, a draft model d ~ 0.3-0.5 plain steps per token, and c(k) (verifying k nodes) grows fast on a
CPU. So the fleet, every step, for every request:

1. asks its cheap members (those without weights) for trees; each tree's nodes get the probability
   of lying on the accepted path from that draft's acceptance history (costs.Acceptance, per depth,
   sibling rank and a per-request context: how deep the draft's previous proposal for this request
   matched), so E[tokens] = 1 + the sum over the verified nodes; each tree is trimmed to the node
   count of best rate E / (plain share + drafting already spent + the marginal verification cost of
   those nodes at this batch, given what the requests before it plan to verify: costs.StepCosts).
   With `merge`, the union of the point-mass trees (a Minions-style vote that keeps every branch) is
   one more candidate: a node's conditional acceptance is the best of its sources', a node's
   children's summing to at most 1;
2. predicts what each expensive member (a draft model, or any member with weights) would give: its
   chain's expected tokens by depth, at the depth k of best rate, its drafting time fitted from its
   own calls (costs.DraftCost) included; a request its cache is far behind (the prompt, on its first
   call) is first caught up in a separately timed `prepare`, and that one-off cost (costs.CatchUpCost)
   is spread over the request's remaining steps (how many: learned from the lengths of the answers that finished
   before it, costs.AnswerLengths, at most its max_tokens left). It is called, for the requests where that rate
   beats both the best cheap rate and plain decoding, with the largest k they want; then its trees compete with
   the cheap ones (its drafting time is spent by then). This prediction takes the member's acceptance optimistically,
   plus `call_bonus` standard errors of its estimate (none for a request whose prompt it has yet to be fed): its
   acceptance is observed only when it is called, so an estimate that started low would otherwise stay low;
3. verifies the candidate of best rate, or nothing when no rate beats plain decoding's 1 token per
   plain share (times `margin`).

Where the target pads a step's requests to its widest tree (CUDA graphs replay a ragged batch so; the engine says
it in StepTiming.padded_rows), a step's cost follows the batch times its widest tree, not the sum of the nodes: the
nodes are priced as padded rows, and step 3 chooses one width for the whole batch, every request verifying its
best tree within it (_padded_plan).

Before all that, a step at a batch size where no tree could pay whatever its acceptance (every depth's
verification costs more than the tokens it could add, on the measured step costs: 8 streams on a
2-core CPU) drafts nothing at all and is timed as a plain step; after `probe_every` such steps (the interval
doubling), one verifies the single likeliest node instead, so that a verdict resting on one slow step is
re-timed.

Learning: after the step, every point-mass candidate (chosen or not) is scored against the tokens the
step committed: with point masses, a node is accepted exactly when the committed token at its depth
spells its path, so unchosen drafts keep learning (and greedy and sampled requests alike). A tree with
draft distributions (a sampled model chain) learns only from its own verification. Every
`explore_every` steps each expensive member is called at its full depth for one of the step's requests (the
one whose feed costs least per token it may still generate; `explore_requests`), unless that request's timed catch-up would cost more than
`explore_budget` of a plain step per remaining token, and that request's cheap trees go untrimmed, so its
acceptance and the cost of longer trees are re-measured; while no
request would have called it on its estimates, the interval doubles (up to 16x), so a draft that does not
pay costs ever less to keep watching.

Step cost: the wall time from the end of one `propose` to the start of the next is the step the
target just ran (forward, verification, commit, bookkeeping) for the planned batch and node count; a
step whose requests changed (a prefill ran), that also computed another request's prompt chunk (the
engine counts those rows: StepTiming.prompt_rows) or that advanced more than one step (a controller
skipped the fleet) is not used. Costs therefore describe the requests this fleet drafts for: use it at the top of
a spec, alone or under +adaptive, rather than as one arm of select(...).

Lossless: every choice (candidate, trimming, calling a model) depends on history and on the shapes
of the trees, never on this step's sampled draft tokens or the target's outputs, so a sampled chain
stays a draw from its draft distributions; merged trees are point masses only.

+adaptive around a fleet still works (its length caps the depth of every member; 0 turns speculation
off), but the fleet already chooses depth per step from costs, so the cap only adds a slower second
loop; the recommended form is the fleet alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from specfleet.errors import InvalidRequestError
from specfleet.strategies.costs import (AnswerLengths, Acceptance, CatchUpCost, DraftCost, StepCosts, matched_nodes,
                                        outcomes)
from specfleet.strategies.fleet_trees import best_subtree, merge_trees, ranked
from specfleet.strategies.length import prune_depth
from specfleet.core.proposer import (Feedback, PreparesKV, Proposer, model_size, set_speculation_length,
                                     speculation_length)
from specfleet.core.tree import DraftTree

MERGED = -1  # the member index of a merged tree
CONTEXT_CAP = 3  # contexts: 0 = no history, 1 + min(depth its last proposal matched, 3)


PLAIN_SAMPLES = 2  # timed plain steps per batch size that _sample_plain asks for
REPAY_MIN_STEPS = 4  # a request's steps behind a forced feed's repay test (FleetConfig.explore_repay)


@dataclass(frozen=True)
class FleetConfig:
    margin: float = 1.0  # speculate only when the best rate beats plain decoding's by this factor
    merge: bool = True  # also consider the union of the point-mass trees
    explore_every: int = 32  # steps between forced calls of each expensive member (0 = never); the
    # interval doubles (up to 16x) after each forced call whose trees no request chose, and resets once one does
    prior_node_cost: float = 0.1  # before any step is timed: a verified node costs this much of a step
    decay: float = 0.99  # forgetting of acceptance counts per observation of a cell
    shrink: float = 2.0  # pseudo-observations pulling a context's estimate to the pooled one
    window: int = 256  # timed steps kept for the linear fits
    # a forced re-measurement of an expensive member skips a request whose catch-up (its prompt, a long absence)
    # would cost more than this share of a plain step per token the request may still generate: an exploring
    # call is pure cost until the member is chosen, so it must stay well inside the 0.97x-of-plain floor
    explore_budget: float = 0.02
    # the first this many forced calls of an expensive member are made whatever their catch-up costs (explore_budget)
    # and keep explore_every's interval: one call's estimates are too few to stop on. With short requests every forced
    # call meets a prompt to feed, so the budget had left the 0.5B judged by the warm-up's single cold call (27 ms a
    # drafted token against ~19, and a 0.67 acceptance that was mostly prior) and never called again (HumanEval,
    # 96-token replies, beside the datastore: 0 of 228 steps, against 70 of 117 when that first call ran fast)
    explore_first: int = 4
    # a batch size whose plain step has been timed fewer than PLAIN_SAMPLES times decodes plain once every this
    # many of its steps (at once on the first; 0 = never): a request's share of a plain step at that batch size is
    # then measured, not extrapolated down from speculative steps, which at 8 streams once read 1.4x the plain
    # step and made the 0.5B look cheap (0.83x plain)
    explore_plain_every: int = 16
    # whether an expensive member is called is judged on its acceptance plus this many standard errors (the errors
    # of few observations; 0 = the estimate alone): its acceptance is only observed when it is called, so a few
    # early rejections kept the 0.5B uncalled for whole runs. On 4 HumanEval prompts its first-token acceptance read
    # 0.43-0.72 after the first prompt in 4 of 6 fresh fleets (true ~0.87); they called it on 3-23 % of the steps
    # and ran 159-223 steps against 111-123 where the first calls went well. Its trees, once drafted, compete on
    # the plain estimates, and so is a call that would first feed it a request's prompt
    call_bonus: float = 1.0
    # at a batch size where no tree pays (_no_tree_pays), one step in this many undrafted ones, the interval doubling
    # up to 32x, verifies the single likeliest node to re-time verification there (_probe_step; 0 = never): the
    # verdict rests on timed speculative steps that an undrafted batch size never makes again
    probe_every: int = 8
    # a forced re-measurement calls the expensive member for this many of the step's requests (those its cache is
    # least behind), their cheap trees untrimmed (0 = every request, as before): one request's chain re-measures
    # its acceptance as well as eight, and at 8 streams forcing it for every request (their prompts fed to the
    # 0.5B, eight untrimmed trees verified) cost ~8 % of the run while it decoded plain 73-84 % of its steps
    explore_requests: int = 1
    # while other requests' prompts are being prefilled (the last step computed prompt rows), an expensive member
    # is not started for a request far behind it (its prompt to feed): the batch is about to grow, and the feed,
    # an investment priced against the rest of the request at today's batch size, is lost once the bigger batch
    # stops calling the member. At 8 streams the 0.5B was so fed during each wave's prefill phase (0.6 s of
    # drafting in a 7.7 s wave). True: invest then too (as before)
    invest_while_prefilling: bool = False
    # an expensive member called for a greedy request drafts one token deeper than its estimates ask while that next
    # depth has been observed fewer than this many (decayed) times in the request's context (0 = never): its depth is
    # chosen from its own estimates, so a depth it stops drafting is never observed again. Two unlucky second tokens
    # early on (the warm-up's) left the 0.5B's depth 2 at 0.43 against a true ~0.9; it then drafted one token a call
    # for the rest of the run, and the fleet with it fell to 0.90x plain on one round of HumanEval (session 32). The
    # deeper token costs a draft forward; it is observed through the target's bonus token whenever the depths above
    # are accepted
    explore_depth: int = 8
    # a forced re-measurement that would feed an expensive member a request's prompt (or a long absence) is made
    # only where even a perfect draft could repay the feed: from the request's own steps so far, the seconds a member
    # drafting every token right at its best depth would have saved against the best cheap candidate, per token, times
    # the tokens the request may still generate, must exceed the feed's measured cost (and the request must have
    # REPAY_MIN_STEPS steps behind it). It binds explore_first's calls too: on code edits (whole files in, the weightless
    # drafts copying 8.6 tokens a step) the 0.5B was never chosen, yet its forced calls fed it 700-1400-token files,
    # 17.3 s of a 4-request run and 10 % of its time (session 32). False: feed as explore_first and the budget allow
    explore_repay: bool = True
    # before an expensive member's catch-up (a prompt fed to its cache) has been timed, each token of it is priced at
    # this share of a plain step at batch 1 (0 = free until timed, as before). The 0.5B's catch-up beside the 1.5B
    # measured 0.03-0.15 of a step a token on 2 CPU cores (0.04-0.09 mostly); priced free, its first feed was made
    # by a tool loop's first step: ~1,400 prompt tokens (4.2 s) for a call that answered in ~20 tokens, once a
    # round, and the default fleet ran at 0.82x plain (BFCL multi-turn, Zen 4, session 34). A forced re-measurement
    # that could repay the prior's price (explore_repay) still times the real cost, after which the prior is unused
    prior_catch_up: float = 0.1
    # an untimed feed whose prior price is within this many plain steps counts as free, as every untimed feed did
    # before the prior: a member's first feed buys its first measurement, for this request and every later one, so a
    # bounded one-off cost is worth it whatever the request (a HumanEval prompt, ~150 tokens: ~15 steps at the prior,
    # fed as before, in the warm-up where there is one). A dearer feed (a tool loop's ~1,400 tokens) is priced at the
    # prior. With every untimed feed priced, the 0.5B went unfed on two of four HumanEval rounds and the default ran at
    # 0.88-0.92x the tree before (Zen 4)
    first_feed_steps: float = 32.0
    # where the target pads a step's requests to its widest tree (StepTiming.padded_rows: CUDA graphs), price nodes
    # as padded rows and choose one width for the batch (_padded_plan). False: price them as their sum (as before)
    price_padded: bool = True
    # the horizon an investment is priced against (a feed spread over the tokens a request will still generate, the
    # repay test, which request a forced call feeds) is learned from the lengths of the last this many finished
    # answers (costs.AnswerLengths), capped by the request's max_tokens left; 0: max_tokens left, as before. A server
    # request without max_tokens may run to the end of the context, so a feed of the 0.5B was judged against
    # thousands of tokens for a tool call that ends after ~20
    answer_window: int = 64
    answer_min_samples: int = 4  # informative finished answers before the learned horizon replaces the prior's
    # until then an answer is expected to run about this many tokens (0: max_tokens left). Without it the first
    # requests of a server loop without max_tokens still fed the 0.5B (BFCL tool loops at max_tokens 2048: one feed a
    # round, 0.89x plain, against 0.52x unlearned; Zen 4, session 36)
    prior_answer_tokens: int = 256

    def validate(self) -> None:
        if self.margin <= 0 or self.explore_every < 0 or self.prior_node_cost < 0 or self.window < 4 \
                or self.explore_budget < 0 or self.explore_plain_every < 0 or self.explore_requests < 0 \
                or self.explore_first < 0 or self.explore_depth < 0 or not self.prior_catch_up >= 0 \
                or self.probe_every < 0 or not self.call_bonus >= 0 \
                or not self.first_feed_steps >= 0 or self.answer_window < 0 or self.answer_min_samples < 1 \
                or self.prior_answer_tokens < 0:
            raise InvalidRequestError("fleet: need margin > 0, explore_every >= 0, prior_node_cost >= 0, window >= 4, "
                                      "explore_budget >= 0, explore_plain_every >= 0, explore_requests >= 0, "
                                      "explore_first >= 0, explore_depth >= 0, prior_catch_up >= 0, "
                                      "first_feed_steps >= 0, answer_window >= 0, answer_min_samples >= 1, "
                                      "prior_answer_tokens >= 0, probe_every >= 0, call_bonus >= 0")
        if not 0.0 < self.decay <= 1.0 or self.shrink < 0:
            raise InvalidRequestError(f"fleet: need 0 < decay <= 1 and shrink >= 0, got {self.decay}, {self.shrink}")


@dataclass
class Option:
    member: int
    tree: DraftTree  # trimmed to what is verified
    expected: float  # tokens
    cost: float  # seconds of the request's step (plain share + drafting + marginal verification)

    @property
    def rate(self) -> float:
        return self.expected / max(self.cost, 1e-12)


@dataclass
class _Pending:
    n0: int  # the request's tokens when drafted
    ctx: list[int]  # each member's context when drafted
    candidates: list[tuple[int, DraftTree]] = field(default_factory=list)
    verified: Option | None = None


def generated_tokens(r) -> int:
    """Tokens the request has generated so far."""
    return r.num_tokens - len(r.prompt_token_ids)


def remaining_tokens(r) -> int:
    """Tokens the request may still generate (its max_tokens less what it has; at least 1)."""
    return max(1, r.params.max_tokens - generated_tokens(r))


class FleetProposer:
    def __init__(self, members: list[Proposer], config: FleetConfig | None = None, name: str | None = None,
                 clock=time.perf_counter):
        names = [m.name for m in members]
        if not members:
            raise InvalidRequestError("fleet(...) needs at least one draft")
        if len(set(names)) != len(names):
            raise InvalidRequestError(f"fleet(...) lists a draft twice: {names}")
        self.config = config or FleetConfig()
        self.config.validate()
        self.children = self.members = list(members)
        self.name = name or f"fleet({','.join(names)})"
        self.clock = clock
        self.cheap = [j for j, m in enumerate(members) if model_size(m) == 0]
        self.expensive = [j for j in range(len(members)) if j not in self.cheap]
        self.max_k = [speculation_length(m) or 4 for m in members]  # each member's configured depth
        cfg = self.config
        self.acceptance = [Acceptance(shrink=cfg.shrink, decay=cfg.decay, num_contexts=CONTEXT_CAP + 2)
                           for _ in members]
        self.draft_costs = [DraftCost(cfg.window) for _ in members]
        self.catch_up = [CatchUpCost() for _ in members]  # an expensive member's cache catching up, per token
        # the horizon of an investment (_remaining)
        self.lengths = AnswerLengths(cfg.answer_window, cfg.answer_min_samples, cfg.prior_answer_tokens)
        # request id -> [tokens generated at its last propose, its max_tokens, whether a later feedback counted its
        # last step]; a released request's entry moves to _finishing until its last feedback can have arrived
        self._progress: dict[str, list] = {}
        self._finishing: dict[str, list] = {}
        self.steps = StepCosts(cfg.window, prior_node_cost=cfg.prior_node_cost)
        self.cap: int | None = None  # a depth cap set from outside (+adaptive)
        self._ctx: dict[str, list[int]] = {}  # request id -> context per member
        self._seen: dict[tuple[str, int], int] = {}  # (request, expensive member) -> tokens when it drafted
        # (request, expensive member not yet fed its prompt) -> [its steps, expected tokens of its best cheap options,
        # seconds a perfect member would have saved on them] (FleetConfig.explore_repay)
        self._repay: dict[tuple[str, int], list] = {}
        self.num_forced_feeds_skipped = 0  # forced re-measurements no perfect draft could have repaid (explore_repay)
        self._since_called = {j: cfg.explore_every for j in self.expensive}
        self._explore_gap = {j: cfg.explore_every for j in self.expensive}
        self._forced_calls = {j: 0 for j in self.expensive}  # forced calls made so far (FleetConfig.explore_first)
        self._plain_gap: dict[int, int] = {}  # batch size -> its steps since a forced plain step (_sample_plain)
        # batch size -> [its undrafted steps since the last probe, the undrafted steps before the next] (_probe_due)
        self._probe_gaps: dict[int, list[int]] = {}
        self._pending: dict[str, _Pending] = {}
        self._plan: tuple[float, int, int, dict[str, tuple[int, int]]] | None = None
        # the engine's measurement of the step since the last plan (observe_step); without an engine (a fleet
        # driven alone) the gap on `clock` between two calls stands in
        self._engine_elapsed: float | None = None
        # the last step computed other requests' prompt rows (observe_step). Unknown at the first propose, which
        # comes before any StepTiming: taken as no, since a first step that prefilled every prompt is as common as
        # one that left some for later (a draft model then kept from the first feeds of a batch of 3 looked too
        # dear to call at all, in the fleet's tests on tiny models)
        self._prefilling = False
        # the target pads a step's requests to its widest tree (StepTiming.padded_rows: CUDA graphs); then nodes are
        # priced as padded rows, batch x the widest tree, and the step's trees are chosen together (_padded_plan)
        self.padded = False
        self._dropped: set[str] = set()
        self._last_batch = 1
        self.num_steps = 0
        self.num_request_steps = 0  # (request, step) pairs: the denominator of the shares
        self.num_undrafted_steps = 0  # steps where no draft could pay at their batch size: nothing was drafted
        self.num_plain_samples = 0  # plain steps decoded to time the plain step at a batch size (_sample_plain)
        self.num_probes = 0  # undrafted steps that verified one node to re-time verification (_probe_step)
        self.chosen: dict[str, int] = {n: 0 for n in names + ["merged", "plain"]}
        self.chosen_by_batch: dict[int, dict[str, int]] = {}  # batch size -> the same counts at that size
        self._stats = {n: {"drafted": 0, "accepted": 0} for n in names}
        self.overhead_s = {"decide": 0.0, "learn": 0.0}

    # -- protocol --------------------------------------------------------------------------------
    def propose(self, requests: list) -> dict[str, DraftTree]:
        t0 = time.perf_counter()
        self._time_step(requests, self._engine_elapsed)
        self._engine_elapsed = None
        for rid in self._dropped:
            self._pending.pop(rid, None)
        self._dropped.clear()
        self._record_answers(requests)
        for r in requests:  # requests that verified nothing learn from the token the target gave them
            pend = self._pending.pop(r.request_id, None)
            if pend is not None:
                self._learn(r.request_id, pend, r.all_token_ids[pend.n0:], None)
        self.overhead_s["learn"] += time.perf_counter() - t0
        self.num_steps += 1
        self.num_request_steps += len(requests)
        batch = self._last_batch = len(requests)
        if self._no_tree_pays(batch):
            if self._probe_due(batch):
                return self._probe_step(requests, batch)
            return self._plain_step(requests, batch)
        self._probe_gaps.pop(batch, None)
        if self._sample_plain(batch):
            return self._plain_step(requests, batch, sample=True)
        explore = {j for j in self.expensive if self.config.explore_every and self._since_called[j] >= self._explore_gap[j]}
        cands: dict[str, list[tuple[int, DraftTree]]] = {r.request_id: [] for r in requests}
        spent = {r.request_id: 0.0 for r in requests}
        for j in self.cheap:
            self._call(j, requests, None, cands, spent)
        t1 = time.perf_counter()
        share, planned, groups, wanted = self.steps.share(batch), 0, {j: [] for j in self.expensive}, set()
        padded = self.padded and batch > 1
        forced = {j: self._explore_sample(requests, j) for j in explore}
        if self.config.explore_repay:
            for j, rids in forced.items():
                hopeless = {r.request_id for r in requests if r.request_id in rids and not self._may_feed(r, j)}
                self.num_forced_feeds_skipped += len(hopeless)
                rids -= hopeless
        sampled = set().union(*forced.values()) if forced else set()
        for r in requests if self.expensive else ():  # first pass: which requests an expensive draft would serve better
            rid = r.request_id
            best = self._best(r, cands[rid], share + spent[rid], planned, untrimmed=rid in sampled)
            for j in self.expensive:
                k, rate, perfect = self._expected_chain(r, j, share + spent[rid], planned)
                if self.config.explore_repay and self._feeds_prompt(r, j):
                    self._note_repay(r, j, best, perfect)
                pays = rate > best.rate and rate > self.config.margin / (share + spent[rid])
                if pays:
                    wanted.add(j)
                asked = pays or (rid in forced.get(j, ()) and (self._forced_calls[j] < self.config.explore_first
                                                               or not self._costly_catch_up(r, j)))
                if asked and not self._feed_waits(r, j, groups[j]):
                    groups[j].append((r, self._explored_depth(r, j, k)))
            planned = max(planned, len(best.tree)) if padded else planned + len(best.tree)
        self.overhead_s["decide"] += time.perf_counter() - t1
        for j, group in groups.items():
            if group:
                k = self.max_k[j] if j in explore else max(k for _, k in group)
                self._call(j, [r for r, _ in group], k, cands, spent)
            self._since_called[j] = 0 if group else self._since_called[j] + 1
            if group and j in explore:
                self._forced_calls[j] += 1
        t2 = time.perf_counter()
        if padded:
            out, per, planned = self._padded_plan(requests, cands, share, spent, sampled)
        else:
            out, per, planned = self._plan_each(requests, cands, share, spent, sampled)
        for j in self.expensive:  # forced calls that the estimates would not have made: re-measure less often
            if j in wanted:
                self._explore_gap[j] = self.config.explore_every
            elif j in explore and self._forced_calls[j] >= self.config.explore_first:
                self._explore_gap[j] = min(2 * self._explore_gap[j], 16 * self.config.explore_every)
        self._plan = (self.clock(), batch, planned, per)
        self.overhead_s["decide"] += time.perf_counter() - t2
        return out

    def _padded_plan(self, requests: list, cands: dict, share: float, spent: dict, sampled: set) -> tuple:
        """The final pass when the target pads a step's requests to its widest tree (self.padded, batch > 1): a
        step verifying trees of at most w nodes costs T(B, B * w) whatever their sizes, so a request whose tree is
        narrower than the widest gets the rest of the width for nothing, and the first request to widen the step
        pays it for all. The width is chosen for the batch at once: for every w, each request takes its candidate
        of most expected tokens within w nodes (its top-w nodes by path probability, closed under ancestors), and the
        w of best total E / (T(B, B * w) + drafting) is verified, when it beats plain decoding's rate (times
        `margin`). A request sampled for a forced re-measurement keeps its candidate untrimmed, so the width is at
        least its size. Pricing nodes as the sum over requests (plan_each) let one request's long tree pad seven
        short ones: at batch 8 on an H200 the default fleet's c(7), c(8) read 1.6-2.2 against 1.1-1.4 at batch 1."""
        batch = len(requests)
        fixed = sum(spent.values())
        per_request, floor = [], 0
        for r in requests:
            rid = r.request_id
            if rid in sampled:  # untrimmed, as _best chooses it
                opt = self._best(r, cands[rid], share + spent[rid], 0, untrimmed=True)
                floor = max(floor, len(opt.tree))
                per_request.append((r, [(opt.member, opt.tree, list(range(len(opt.tree))), None, opt.expected)]))
                continue
            per_request.append((r, [(j, tree, *ranked(probs), None) for j, tree, probs in self._scored(r, cands[rid])]))

        def expected(opt, w: int) -> float:
            j, tree, order, prefix, whole = opt
            if prefix is None:  # untrimmed: all of it or nothing
                return whole if len(tree) <= w else 1.0
            return prefix[min(w, len(tree))]

        widest = max((len(o[1]) for _, opts in per_request for o in opts), default=0)
        base = self.steps.step_time(batch, 0) + fixed
        best_w, best_rate = 0, self.config.margin * batch / base
        if floor:
            best_w, best_rate = floor, -1.0
        for w in range(max(floor, 1), widest + 1):
            e = sum(max((expected(o, w) for o in opts), default=1.0) for _, opts in per_request)
            rate = e / (self.steps.step_time(batch, batch * w) + fixed)
            if rate > best_rate:
                best_w, best_rate = w, rate
        out, per, width = {}, {}, 0
        extra = (self.steps.step_time(batch, batch * best_w) - self.steps.step_time(batch, 0)) / batch
        for r, opts in per_request:
            rid = r.request_id
            pend = self._pending[rid] = _Pending(r.num_tokens, list(self._context(rid)), cands[rid])
            name = "plain"
            if best_w and opts:
                opt = max(opts, key=lambda o: expected(o, best_w))  # the first of the best on ties
                e = expected(opt, best_w)
                if e > 1.0:
                    j, tree, order, prefix, _ = opt
                    keep = sorted(order[:best_w]) if prefix is not None else order
                    chosen = Option(j, tree.subtree(keep), e, share + spent[rid] + extra)
                    out[rid], pend.verified = chosen.tree, chosen
                    width = max(width, len(chosen.tree))
                    name = "merged" if j == MERGED else self.members[j].name
            self._count_choice(batch, name)
            per[rid] = (r.num_tokens, len(out[rid]) if rid in out else 0)
        return out, per, batch * width

    def _plan_each(self, requests: list, cands: dict, share: float, spent: dict, sampled: set) -> tuple:
        """The final pass, request by request: each verifies its candidate of best rate, given the nodes the
        requests before it plan (their sum prices the step), or nothing when no rate beats plain decoding's."""
        out, planned, per = {}, 0, {}
        for r in requests:
            rid = r.request_id
            best = self._best(r, cands[rid], share + spent[rid], planned, untrimmed=rid in sampled)
            pend = self._pending[rid] = _Pending(r.num_tokens, list(self._context(rid)), cands[rid])
            if len(best.tree) and best.rate > self.config.margin / (share + spent[rid]):
                out[rid] = best.tree
                pend.verified = best
                planned += len(best.tree)
            name = "plain" if rid not in out else "merged" if best.member == MERGED else self.members[best.member].name
            self._count_choice(len(requests), name)
            per[rid] = (r.num_tokens, len(out[rid]) if rid in out else 0)
        return out, per, planned

    def _explore_sample(self, requests: list, j: int) -> set[str]:
        """The requests a forced call of member j drafts for (FleetConfig.explore_requests; 0 = all): those whose
        feed costs least per token they may still generate (the tokens its cache is behind over the request's
        remaining tokens), so the re-measurement feeds little and what it feeds can still pay. Least behind alone
        chose, at 4 streams on the CPU, a request 7 tokens from its end whose short prompt made it the least behind:
        0.2-0.25 s of the 0.5B's prompt feed per fresh fleet, spent for nothing (the fleet read 0.96x plain there).
        From history only."""
        n = self.config.explore_requests
        if not n or n >= len(requests):
            return {r.request_id for r in requests}
        key = lambda r: (self._gap(r, j) / self._remaining(r), self._gap(r, j), r.request_id)  # noqa: E731
        return {r.request_id for r in sorted(requests, key=key)[:n]}

    def _no_tree_pays(self, batch: int) -> bool:
        """Whether no draft could pay at this batch size whatever its acceptance, on the measured step costs: for
        every depth n a member drafts, verifying n nodes costs more than the n tokens they could add at most are
        worth (a tree of n nodes at depth <= n adds at most n; the marginal cost only grows with more nodes). Then
        nothing is drafted: at 8 streams on a 2-core CPU a verified node costs more than a request's share of the
        plain step, and calling the cheap drafts and deciding for 8 requests each step cost ~2 % of the run for
        nothing. Decided from history only (the cost model), so a sampled request's output is unaffected."""
        if not self.steps.measured:
            return False
        share, margin = self.steps.share(batch), self.config.margin
        # padded (self.padded): a width of n costs every request its share of the padded rows, each adding <= n
        per = batch if self.padded and batch > 1 else 1
        return all((1 + n) * share <= margin * (share + self._extra(batch, 0, n) / per)
                   for n in range(1, self.num_speculative_tokens + 1))

    def _probe_due(self, batch: int) -> bool:
        """Whether this step, at a batch size where no tree pays (_no_tree_pays), probes instead (_probe_step):
        after `probe_every` undrafted steps there, then after twice as many each time (up to 32x), the interval
        starting over once a step there drafts again. The verdict rests on timed speculative steps, and a batch size
        that drafts nothing is never timed speculating again: one slow first verification (3.3 plain steps for 2
        nodes at batch 1, Zen 4) had held the weightless fleet plain for a whole run, 1.05x plain against 1.29x in
        the run before. Decided from history only, so a sampled request's output is unaffected."""
        every = self.config.probe_every
        if not every:
            return False
        gap = self._probe_gaps.setdefault(batch, [0, every])
        gap[0] += 1
        if gap[0] < gap[1]:
            return False
        gap[0], gap[1] = 0, min(2 * gap[1], 32 * every)
        return True

    def _probe_step(self, requests: list, batch: int) -> dict[str, DraftTree]:
        """A step that re-times verification where no tree pays: the cheap members draft (and keep learning) and
        one node is verified, the one of highest path probability over the step's requests and candidates, so the
        step is timed at one node more than plain. One node is the cheapest measurement and the count whose cost
        decides _no_tree_pays first; once it is timed as cheap, the fleet drafts and verifies as it estimates
        again. Nothing is verified when no cheap member proposed anything (the interval still grows)."""
        self.num_probes += 1
        cands: dict[str, list[tuple[int, DraftTree]]] = {r.request_id: [] for r in requests}
        spent = {r.request_id: 0.0 for r in requests}
        for j in self.cheap:
            self._call(j, requests, None, cands, spent)
        top = None  # (path probability, request index, member, tree, node)
        for i, r in enumerate(requests):
            for j, tree, probs in self._scored(r, cands[r.request_id]):
                if len(tree):
                    node = ranked(probs)[0][0]  # a root child: path probabilities never grow down a path
                    if top is None or probs[node] > top[0]:
                        top = (probs[node], i, j, tree, node)
        out, per, share = {}, {}, self.steps.share(batch)
        for i, r in enumerate(requests):
            rid = r.request_id
            pend = self._pending[rid] = _Pending(r.num_tokens, list(self._context(rid)), cands[rid])
            name = "plain"
            if top is not None and top[1] == i:
                p, _, j, tree, node = top
                pend.verified = Option(j, tree.subtree([node]), 1.0 + p, share + spent[rid])
                out[rid] = pend.verified.tree
                name = "merged" if j == MERGED else self.members[j].name
            self._count_choice(batch, name)
            per[rid] = (r.num_tokens, len(out[rid]) if rid in out else 0)
        self._plan = (self.clock(), batch, batch if out and self.padded and batch > 1 else len(out), per)
        return out

    def _sample_plain(self, batch: int) -> bool:
        """Whether this step decodes plain to time the plain step at this batch size (explore_plain_every):
        while fewer than PLAIN_SAMPLES plain steps were timed at it, on its first step and then every
        explore_plain_every of its steps. Without them the plain step there is extrapolated from speculative
        steps (StepCosts), and an overestimate makes every draft look cheap beside it. Decided from history only,
        so a sampled request's output is unaffected."""
        every = self.config.explore_plain_every
        if not every or not self.steps.measured or self.steps.plain_samples(batch) >= PLAIN_SAMPLES:
            return False
        gap = self._plain_gap.get(batch, every - 1) + 1
        self._plain_gap[batch] = 0 if gap >= every else gap
        return gap >= every

    def _plain_step(self, requests: list, batch: int, sample: bool = False) -> dict[str, DraftTree]:
        """A step where nothing is drafted (_no_tree_pays; with `sample`, _sample_plain); still timed, as a plain
        step of this batch size."""
        if sample:
            self.num_plain_samples += 1
        else:
            self.num_undrafted_steps += 1
        self._count_choice(batch, "plain", batch)
        self._plan = (self.clock(), batch, 0, {r.request_id: (r.num_tokens, 0) for r in requests})
        return {}

    def _record_answers(self, requests: list) -> None:
        """Record the answers released since the last propose (their last step's feedback, if any, has arrived by
        now), and note where each live request stands; a request seen again was preempted, not finished."""
        for rid, (n, cap, counted) in self._finishing.items():
            n = n if counted else n + 1  # a plain last step (no feedback) added one token
            self.lengths.finish(rid, n, n >= cap)
        self._finishing.clear()
        for r in requests:
            self._progress[r.request_id] = [generated_tokens(r), r.params.max_tokens, False]
            self.lengths.forget(r.request_id)

    def _remaining(self, r) -> float:
        """Tokens `r` is expected to generate still: the learned horizon (FleetConfig.answer_window), at most its
        max_tokens left."""
        return self.lengths.remaining(generated_tokens(r), remaining_tokens(r))

    def _count_choice(self, batch: int, name: str, n: int = 1) -> None:
        self.chosen[name] += n
        self.chosen_by_batch.setdefault(batch, dict.fromkeys(self.chosen, 0))[name] += n

    def observe(self, feedback: list[Feedback]) -> None:
        t0 = time.perf_counter()
        for fb in feedback:
            fin = self._finishing.get(fb.request_id)
            if fin is not None and not fin[2]:  # the released request's last step: its tokens count
                fin[0] += len(fb.emitted_token_ids)
                fin[2] = True
            pend = self._pending.pop(fb.request_id, None)
            if pend is not None:
                self._learn(fb.request_id, pend, fb.emitted_token_ids, fb)
            accepted = set(fb.accepted_nodes)
            for j, origin in enumerate(fb.tree.origins):
                if origin in self._stats:
                    self._stats[origin]["drafted"] += 1
                    self._stats[origin]["accepted"] += j in accepted
        self.overhead_s["learn"] += time.perf_counter() - t0

    def release(self, request_id: str) -> None:
        self._dropped.add(request_id)  # its last feedback may still arrive in this step's observe
        progress = self._progress.pop(request_id, None)
        if progress is not None:  # recorded as an answer at the next propose (_record_answers)
            self._finishing[request_id] = progress
        self._ctx.pop(request_id, None)
        for j in self.expensive:
            self._seen.pop((request_id, j), None)
            self._repay.pop((request_id, j), None)
        for m in self.members:
            m.release(request_id)

    @property
    def num_speculative_tokens(self) -> int:
        return self.cap if self.cap is not None else max(self.max_k)

    def set_num_speculative_tokens(self, n: int) -> None:
        self.cap = n

    def state(self) -> dict:
        return {"fleet": self.fleet_report(),
                "overhead_s": {k: round(v, 6) for k, v in self.overhead_s.items()}}

    # -- deciding --------------------------------------------------------------------------------
    def _context(self, rid: str) -> list[int]:
        return self._ctx.setdefault(rid, [0] * len(self.members))

    def _call(self, j: int, requests: list, k: int | None, cands: dict, spent: dict) -> None:
        """Draft with member j (at depth k, if given), timing it; its trees join the candidates."""
        member = self.members[j]
        if k is not None:
            set_speculation_length(member, k)
            self._catch_up(j, requests)
        gap = sum(self._gap(r, j) for r in requests) / len(requests)
        t0 = self.clock()
        trees = member.propose(requests)
        dt = self.clock() - t0
        nodes = sum(len(t) for t in trees.values())
        self.draft_costs[j].add(dt, len(requests), k or self.max_k[j], gap if k is not None else 0.0, nodes)
        for r in requests:
            spent[r.request_id] += dt / len(requests)
            if k is not None:
                self._seen[(r.request_id, j)] = r.num_tokens
            tree = trees.get(r.request_id)
            if tree is not None and self.cap is not None:
                tree = prune_depth(tree, self.cap)
            if tree is not None and len(tree):
                cands[r.request_id].append((j, tree))

    def _gap(self, r, j: int) -> int:
        """Tokens of `r` that member j's cache has not been fed (all of them before its first call)."""
        return r.num_tokens - self._seen.get((r.request_id, j), 0)

    def _far(self, j: int) -> int:
        """How many tokens behind an expensive member's cache is 'far': its first call for a request (the
        whole prompt) or a return after a long absence, rather than a step's usual catch-up."""
        return 2 * self.max_k[j] + 2

    def _costly_catch_up(self, r, j: int) -> bool:
        """Whether calling member j for `r` would first mean a catch-up (a new request's prompt, a long absence) whose
        cost (measured, or the prior's: _catch_up_seconds), spread over the tokens the request may still generate,
        exceeds `explore_budget` (0.02) of a plain step each: a forced re-measurement does not pay for that (a call the
        estimates choose still can). On a ShareGPT run (96-token replies) the 0.5B's forced calls spent ~1 s of prompt
        prefill each, 10 % of the fleet's time (benchmarks/RESULTS.md, the fleet preset); on 8 HumanEval prompts x 96
        tokens at one stream (Zen 5, 2 cores) a budget of a tenth still let every request's ~150-token prompt be fed to
        the 0.5B (7 ms a token, ~11 ms per remaining token against a 12 ms tenth of a step) and the fleet holding the
        0.5B ran at 0.73x plain. With a long horizon ahead the re-measurement stays cheap and keeps an early,
        pessimistic estimate from sticking."""
        gap = self._gap(r, j)
        if gap <= self._far(j) or not self.steps.measured:
            return False
        per_step = self._catch_up_seconds(j, gap - 1) / self._remaining(r)
        return per_step > self.config.explore_budget * self.steps.share(self._last_batch)

    def _catch_up_seconds(self, j: int, tokens: int) -> float:
        """Expected seconds (step units before any step is timed) of member j catching up `tokens` tokens: its timed
        cost per token, or before one was timed `prior_catch_up` of a plain step at batch 1 per token, and nothing
        where that comes to `first_feed_steps` plain steps or fewer (a first measurement's one-off price)."""
        if self.catch_up[j].tokens:
            return self.catch_up[j].seconds(tokens)
        steps = self.config.prior_catch_up * max(tokens, 0)
        return 0.0 if steps <= self.config.first_feed_steps else steps * self.steps.share(1)

    def _feeds_prompt(self, r, j: int) -> bool:
        """Whether calling member j for `r` would first feed its cache a prompt's worth of tokens (a new request, a
        long absence) rather than a step's usual catch-up."""
        return isinstance(self.members[j], PreparesKV) and self._gap(r, j) > self._far(j)

    def _feed_waits(self, r, j: int, group: list) -> bool:
        """Whether `r` must wait before member j is fed its prompt (_feeds_prompt), for either of two reasons:
        - the batch is growing (the last step prefilled other prompts) and `invest_while_prefilling` is off: the
          feed, priced against the rest of the request at today's batch size, is lost once the bigger batch stops
          calling the member (at 8 streams the 0.5B was fed so in each wave's prefill phase: 1.34 s of drafting in
          a 9.2 s wave against plain's 7.4);
        - j's catch-up has no measured cost yet and another request far behind already joins this call: the
          first catch-up prices it, and until then a call's estimates see it as free (a wave of 8 HumanEval
          prompts fed all 8 to the 0.5B on its first call, ~1 s of draft prefill in a 14 s run, Zen 5, 2 cores)."""
        if not self._feeds_prompt(r, j):
            return False
        if self._prefilling and not self.config.invest_while_prefilling:
            return True
        return not self.catch_up[j].tokens and any(self._feeds_prompt(q, j) for q, _ in group)

    def _catch_up(self, j: int, requests: list) -> None:
        """Bring member j's cache up to the committed tokens of the requests far behind, timed apart from
        drafting: that cost is paid once per request (an investment the later steps share, see
        _expected_chain), so folding it into the per-call drafting cost made a draft model look several
        plain steps per token dear after its first calls, and the fleet then never chose it."""
        member = self.members[j]
        far = [r for r in requests if self._gap(r, j) > self._far(j)]
        if not far or not isinstance(member, PreparesKV):
            return
        tokens = sum(self._gap(r, j) - 1 for r in far)
        t0 = self.clock()
        member.prepare(far)
        self.catch_up[j].add(self.clock() - t0, tokens)
        for r in far:
            self._seen[(r.request_id, j)] = r.num_tokens - 1

    def _extra(self, batch: int, planned: int, nodes: int) -> float:
        """Extra seconds of a step at `batch` when one request verifies `nodes` more, given `planned`: the nodes
        the requests before it verify in all, or where the target pads (self.padded) the widest tree so far, whose
        width every request pays for (a step of width w costs T(batch, batch * w))."""
        if not (self.padded and batch > 1):
            return self.steps.marginal(batch, planned, nodes)
        if nodes <= planned:
            return 0.0
        return max(self.steps.step_time(batch, batch * nodes) - self.steps.step_time(batch, batch * planned), 0.0)

    def _scored(self, r, cands: list) -> list[tuple[int, DraftTree, list[float]]]:
        """(member, tree, its nodes' path probabilities) for each candidate of `r`, and with `merge` the union of
        its point-mass trees (member MERGED)."""
        ctx = self._context(r.request_id)
        scored = [(j, t, self.acceptance[j].path_probs(t, ctx[j])) for j, t in cands]
        point = [(t, p) for _, t, p in scored if t.draft_probs is None]
        if self.config.merge and len(point) > 1:
            scored.append((MERGED, *merge_trees([t for t, _ in point], [p for _, p in point])))
        return scored

    def _best(self, r, cands: list, fixed: float, planned: int, untrimmed: bool) -> Option:
        """The candidate (trimmed) of best rate; an empty Option (plain decoding) when none."""
        batch = self._last_batch
        extra = lambda m: self._extra(batch, planned, m)  # noqa: E731
        best = Option(MERGED, DraftTree(), 1.0, fixed)
        for j, tree, probs in self._scored(r, cands):
            if untrimmed:
                keep, e = list(range(len(tree))), 1.0 + sum(probs)
                cost = fixed + extra(len(tree))
            else:
                keep, e, cost = best_subtree(probs, fixed, extra)
            opt = Option(j, tree.subtree(keep), e, cost)
            if len(opt.tree) and (not len(best.tree) or opt.rate > best.rate):
                best = opt
        return best

    def _depth_cap(self, j: int) -> int:
        """The deepest chain member j may draft: its configured depth, within the fleet's cap where one is set."""
        return min(self.max_k[j], self.cap) if self.cap is not None else self.max_k[j]

    def _explored_depth(self, r, j: int, k: int) -> int:
        """`k`, or k + 1 while member j's depth k + 1 has been observed fewer than `explore_depth` times in r's
        context (the cell its estimate for r reads, which may hold a depth's unlucky start while the pooled one has
        recovered) and `r` is greedy (a sampled chain teaches only through its verified nodes, which the trim may
        cut)."""
        kmax = self._depth_cap(j)
        ctx = self._context(r.request_id)[j]
        if k < kmax and r.params.is_greedy and self.acceptance[j].tried(ctx, k + 1) < self.config.explore_depth:
            return k + 1
        return k

    def _note_repay(self, r, j: int, best: Option, perfect: float) -> None:
        """Record, for a request member j has not been fed, what a perfect j (drafting at `perfect` tokens a second,
        _expected_chain) would have saved on this step against `best` (the step's best cheap option, or plain
        decoding): the seconds of best's expected tokens at best's cost less their seconds at the perfect rate, where
        that is less, kept in plain steps (a request's share at the step's batch size): before any step is timed the
        costs are in step units, and summed with later seconds they had made a tool loop's first two steps (1.1
        'seconds' each) read as a saving of 0.11 s a token on a 0.04 s step, which fed the 0.5B a 1,400-token
        prompt for a 20-token answer (BFCL multi-turn, Zen 4)."""
        h = self._repay.setdefault((r.request_id, j), [0, 0.0, 0.0])
        h[0] += 1
        h[1] += best.expected
        h[2] += max(0.0, best.cost - best.expected / perfect) / self.steps.share(self._last_batch)

    def _may_feed(self, r, j: int) -> bool:
        """Whether a forced re-measurement may call member j for `r` (FleetConfig.explore_repay): yes when the call
        feeds no prompt; else only after REPAY_MIN_STEPS of r's steps, and when a perfect j's savings per token on
        them, times the tokens r may still generate, exceed the feed's cost (measured, or before that the prior's;
        a first feed within `first_feed_steps` is free: any saving, _catch_up_seconds). From history only."""
        if not self._feeds_prompt(r, j):
            return True
        h = self._repay.get((r.request_id, j))
        if h is None or h[0] < REPAY_MIN_STEPS:
            return False
        invest = self._catch_up_seconds(j, self._gap(r, j) - 1)
        return self._remaining(r) * h[2] / max(h[1], 1e-9) * self.steps.share(self._last_batch) > invest

    def _expected_chain(self, r, j: int, fixed: float, planned: int) -> tuple[int, float, float]:
        """(depth, rate) of the best chain member j is expected to draft for `r`, and the rate at j's best depth if
        every token it drafted were right, the feed of a request far behind left out (a bound no real acceptance
        beats, for FleetConfig.explore_repay)."""
        acc, ctx = self.acceptance[j], self._context(r.request_id)[j]
        gap = self._gap(r, j)
        invest, horizon, bonus = 0.0, 1.0, self.config.call_bonus
        if gap > self._far(j):  # the catch-up is paid once and shared by the request's remaining steps
            invest, horizon = self._catch_up_seconds(j, gap - 1), self._remaining(r)
            gap = 1
            if (r.request_id, j) not in self._seen:  # a request j never had: its prompt's feed is judged on the
                bonus = 0.0  # estimates alone (an investment: tool loops' 1,400-token prompts, session 34)
        kmax = self._depth_cap(j)
        best_k, best_rate, perfect, e, path = 1, 0.0, 0.0, 1.0, 1.0
        for k in range(1, max(kmax, 1) + 1):
            path *= acc.upper(ctx, k, 0, bonus)
            e += path
            draft = self.draft_costs[j].per_request(k, gap) if self.steps.measured else 0.0
            step = fixed + draft + self._extra(self._last_batch, planned, k)
            perfect = max(perfect, (k + 1) / step)
            if invest:
                step += invest / max(1.0, horizon / e)
            rate = e / step
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate, perfect

    # -- learning --------------------------------------------------------------------------------
    def observe_step(self, timing) -> None:
        """The engine's seconds from the end of this fleet's last plan to now (core/proposer.StepTiming). A
        fleet built with a clock of its own (a simulation, a reproducible test) keeps that clock instead."""
        self._prefilling = bool(timing.prompt_rows)
        self.padded = timing.padded_rows and self.config.price_padded
        if timing.prompt_rows or timing.warmups:
            # a step that also computed another request's prompt chunk is no decode step of this batch: at 8 streams
            # the prompts of a wave are prefilled in chunks beside the first requests' decoding, and those steps,
            # timed as decode steps, made a plain step look 2-3x dearer than it is, so speculation (and the 0.5B)
            # looked cheap beside it; such a step is left untimed, like one a prefill joined (_time_step). So is a
            # step that captured a CUDA graph (three forwards in one): a node count tried once and timed so would look
            # three times dearer than it is, and a cell the fleet stops choosing is never timed again
            self._plan = None
        elif self.clock is time.perf_counter:
            self._engine_elapsed = timing.seconds

    def _time_step(self, requests: list, elapsed: float | None) -> None:
        """Learn the step cost of the last plan (batch, drafted nodes) from `elapsed` seconds (the engine's;
        None: this fleet's own clock)."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        end, batch, nodes, per = plan
        for r in requests:
            entry = per.get(r.request_id)
            if entry is None or not 1 <= r.num_tokens - entry[0] <= entry[1] + 1:
                return  # a prefill joined this step, or more than one step passed
        if elapsed is None:
            elapsed = self.clock() - end
        if elapsed > 0 and not (self.steps.measured and elapsed > 10 * self.steps.step_time(batch, nodes)):
            self.steps.add(batch, nodes, elapsed)

    def _learn(self, rid: str, pend: _Pending, new: list[int], fb: Feedback | None) -> None:
        """Learn from the tokens committed since the candidates were drafted."""
        ctx = self._ctx.get(rid)  # None once released: its history is no longer needed
        for j, tree in pend.candidates:
            if tree.draft_probs is None:
                accepted, depth = matched_nodes(tree, new), len(new)
            elif fb is not None and pend.verified is not None and pend.verified.member == j:
                accepted, depth = set(fb.accepted_nodes), min(fb.num_emitted, len(fb.tree))
            else:
                continue  # a sampled chain that was not verified: no unbiased outcome
            if depth < 1:
                continue
            for d, rank, ok in outcomes(tree, accepted, depth):
                self.acceptance[j].add(pend.ctx[j], d, rank, ok)
            if ctx is not None:
                ctx[j] = 1 + min(max((tree.depths()[a] for a in accepted), default=0), CONTEXT_CAP)

    # -- reporting -------------------------------------------------------------------------------
    @property
    def draft_stats(self) -> dict[str, dict]:
        """Member name -> drafted / accepted tokens it sent, and its share of the requests' steps."""
        steps = max(self.num_request_steps, 1)
        return {m.name: {**self._stats[m.name], "steps": self.chosen[m.name],
                         "share": round(self.chosen[m.name] / steps, 4)} for m in self.members}

    def fleet_report(self, max_nodes: int = 8) -> dict:
        """What the fleet did and measured: shares of the requests' steps (members, merged, plain),
        each member's d in plain steps (a request's share at the last batch size) and in seconds per
        drafted token, the fitted c(0..max_nodes) at the last batch size, and each member's
        conditional acceptance by position (first child per depth, pooled over contexts)."""
        steps = max(self.num_request_steps, 1)
        batch = self._last_batch
        unit = self.steps.share(batch) if self.steps.measured else None
        return {
            "steps": self.num_steps,
            "undrafted_steps": self.num_undrafted_steps,
            "plain_samples": self.num_plain_samples,
            "probes": self.num_probes,
            "forced_feeds_skipped": self.num_forced_feeds_skipped,
            "request_steps": self.num_request_steps,
            "share": {n: round(c / steps, 4) for n, c in self.chosen.items()},
            "d_s": {m.name: self.draft_costs[j].d for j, m in enumerate(self.members)},
            "catch_up_s_per_token": {m.name: self.catch_up[j].per_token for j in self.expensive
                                     for m in [self.members[j]] if self.catch_up[j].tokens},
            "d": {m.name: round(self.draft_costs[j].d / unit, 4) if unit else None for j, m in enumerate(self.members)},
            "calls": {m.name: self.draft_costs[j].calls for j, m in enumerate(self.members)},
            "c": self._c_report(max_nodes, batch),
            "c_batch": batch,
            "padded_rows": self.padded,
            "step_s": self.steps.step_time(batch, 0) if self.steps.measured else None,
            "timed_steps": self.steps.num_observations,
            "acceptance_by_position": {m.name: [round(x, 3) for x in self.acceptance[j].by_position()]
                                       for j, m in enumerate(self.members)},
            "by_batch": self._by_batch_report(max_nodes),
        }

    def _by_batch_report(self, max_nodes: int) -> dict[str, dict]:
        """Per batch size the fleet drafted at: its request steps, the shares of each choice there, the
        step time it expects with no drafts and c(0..max_nodes) at that size (one request's nodes)."""
        out = {}
        for b, counts in sorted(self.chosen_by_batch.items()):
            n = max(sum(counts.values()), 1)
            out[str(b)] = {"request_steps": sum(counts.values()),
                           "share": {k: round(v / n, 4) for k, v in counts.items() if v},
                           "step_s": self.steps.step_time(b, 0) if self.steps.measured else None,
                           "c": self._c_report(max_nodes, b)}
        return out

    def _c_report(self, max_nodes: int, batch: int) -> list[float] | None:
        """c(0..max_nodes) at `batch`: one request's nodes, the rest plain; where the target pads (self.padded) a
        width's, every request padded to it (T(batch, batch * w) over the plain step)."""
        if not self.steps.measured:
            return None
        if not (self.padded and batch > 1):
            return [round(x, 4) for x in self.steps.c(max_nodes, batch)]
        base = self.steps.step_time(batch, 0)
        return [round(self.steps.step_time(batch, batch * w) / base, 4) for w in range(max_nodes + 1)]
