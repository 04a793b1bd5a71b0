"""Speculative decoding statistics, per request and in aggregate.

Conventions (the same in the API, the CLI, the server and the benchmarks):
- a *step* is one target forward pass that verified a draft for this request (possibly empty); the
  prefill pass that emits a request's first token is not a step, but its token counts as emitted;
- drafted = draft tokens (tree nodes) sent to the target; accepted = draft tokens kept;
- acceptance rate = accepted / drafted (for trees, drafted counts every node, so a wide tree has a
  lower rate for the same accepted length);
- mean accepted length = (accepted + steps) / steps = tokens emitted per target pass, counting the
  bonus (or correction) token the target always contributes; plain decoding scores exactly 1;
- acceptance by position k = fraction of steps whose accepted path reached depth k (k = 1, 2, ...);
- a depth is *judged* in a step when the target decided a draft token there: every accepted depth, and the
  depth after them where the tree had a child of the last accepted node (the first rejection). Per-token
  acceptance = accepted / judged, the chance the target keeps a drafted token whose prefix it kept (the
  alpha of the speculative-sampling papers; for a chain it does not fall with the chain's length as
  accepted / drafted does), and per position k = steps accepting depth k / steps judging it;
- goodput = emitted tokens / wall time spent drafting and verifying.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _add_counts(into: list[int], counts: list[int]) -> None:
    """Per-depth counts added in place, `into` grown to the longer length."""
    into.extend([0] * (len(counts) - len(into)))
    for k, c in enumerate(counts):
        into[k] += c


@dataclass
class SpecStats:
    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)  # [k] = steps reaching depth k+1
    num_judged: int = 0  # draft positions the target judged (accepted ones and first rejections)
    judged_at_depth: list[int] = field(default_factory=list)  # [k] = steps that judged a token at depth k+1
    draft_time: float = 0.0
    verify_time: float = 0.0
    drafts_used: dict[str, int] = field(default_factory=dict)  # proposer name -> steps it drafted
    drafted_by: dict[str, int] = field(default_factory=dict)  # proposer name -> draft tokens it sent
    accepted_by: dict[str, int] = field(default_factory=dict)  # proposer name -> its tokens accepted
    # proposer calls that raised; the requests they were for went on by plain decoding (engine.py)
    num_draft_failures: int = 0
    num_draft_fallbacks: int = 0  # requests turned to plain decoding by those failures (each counted once)
    # rows the target computed for prompt chunks (and recomputation after a preemption) beside the decoding
    # requests' rows: a step with any is not a decode step, and the fleet does not learn decode costs from it
    prompt_rows: int = 0
    # target forwards that captured a CUDA graph of their shape (runtime/backends/cuda/graphs.py: the forward ran
    # three times); cost models leave such a step untimed
    warmup_steps: int = 0

    def record_step(self, num_drafted: int, num_accepted: int, num_emitted: int, proposer: str | None,
                    num_judged: int | None = None) -> None:
        """`num_judged`: the depths judged (num_accepted, plus one where a draft token after them was
        rejected; default num_accepted, as for a chain accepted whole or cut by a stop)."""
        judged = num_accepted if num_judged is None else num_judged
        if not num_accepted <= judged <= num_accepted + 1:
            raise ValueError(f"judged depths {judged} with {num_accepted} accepted: it is the accepted ones or one more")
        self.num_judged += judged
        _add_counts(self.judged_at_depth, [1] * judged)
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted += num_emitted
        _add_counts(self.accepted_at_depth, [1] * num_accepted)
        if proposer is not None and num_drafted:
            self.drafts_used[proposer] = self.drafts_used.get(proposer, 0) + 1
            self.drafted_by[proposer] = self.drafted_by.get(proposer, 0) + num_drafted
            self.accepted_by[proposer] = self.accepted_by.get(proposer, 0) + num_accepted

    def merge(self, other: "SpecStats") -> None:
        self.num_steps += other.num_steps
        self.num_drafted += other.num_drafted
        self.num_accepted += other.num_accepted
        self.num_emitted += other.num_emitted
        _add_counts(self.accepted_at_depth, other.accepted_at_depth)
        self.num_judged += other.num_judged
        _add_counts(self.judged_at_depth, other.judged_at_depth)
        self.draft_time += other.draft_time
        self.verify_time += other.verify_time
        self.num_draft_failures += other.num_draft_failures
        self.num_draft_fallbacks += other.num_draft_fallbacks
        self.prompt_rows += other.prompt_rows
        self.warmup_steps += other.warmup_steps
        for mine, theirs in ((self.drafts_used, other.drafts_used), (self.drafted_by, other.drafted_by),
                             (self.accepted_by, other.accepted_by)):
            for name, c in theirs.items():
                mine[name] = mine.get(name, 0) + c

    def acceptance_by_draft(self) -> dict[str, float]:
        return {name: self.accepted_by.get(name, 0) / n for name, n in self.drafted_by.items() if n}

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def per_token_acceptance(self) -> float:
        return self.num_accepted / self.num_judged if self.num_judged else 0.0

    @property
    def per_token_acceptance_by_position(self) -> list[float]:
        return [(self.accepted_at_depth[k] if k < len(self.accepted_at_depth) else 0) / n
                for k, n in enumerate(self.judged_at_depth)]

    @property
    def mean_accepted_length(self) -> float:
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [c / self.num_steps for c in self.accepted_at_depth] if self.num_steps else []

    @property
    def goodput(self) -> float:
        t = self.draft_time + self.verify_time
        return self.num_emitted / t if t > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.num_steps,
            "drafted": self.num_drafted,
            "accepted": self.num_accepted,
            "judged": self.num_judged,
            "emitted": self.num_emitted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "per_token_acceptance": round(self.per_token_acceptance, 4),
            "per_token_acceptance_by_position": [round(x, 4) for x in self.per_token_acceptance_by_position],
            "draft_time_s": round(self.draft_time, 4),
            "verify_time_s": round(self.verify_time, 4),
            "goodput_tok_s": round(self.goodput, 2),
            "drafts_used": dict(self.drafts_used),
            "acceptance_by_draft": {k: round(v, 4) for k, v in self.acceptance_by_draft().items()},
            "draft_failures": self.num_draft_failures,
            "draft_fallbacks": self.num_draft_fallbacks,
        }
