"""Per-row losslessness, checked bit for bit against plain decode steps.

Speculation is lossless only if every row that a verification step scores gets exactly the logits that a
plain decode step of the same token, after the same context, gets. Output equality alone cannot show it:
a row may differ by 1e-7 and still pick the same argmax on most prompts, until a near-tie flips.

`RowChecker.attach(engine)` wraps the engine's model runner. After every forward it replays each logit
row (decode rows, the last row of a prompt, the root and every node of a verified chain or tree) as a
plain one-token decode step of its own, in a scratch KV cache:

    row r of an item (its request has `context_len` cached tokens; the item's new tokens follow them)
    visible keys  = the context, then the new tokens its mask lets it see (a tree node: the root, its
                    ancestors and itself), as the forward wrote them into the engine's cache
    reference     = copy all visible keys but its own into scratch slots 0.., in that order, then decode
                    the row's token after them (a batch of one, the engine's own decode path)
    check         = the reference logits equal the row's logits bit for bit, and the K/V the decode
                    writes for the token (every layer) equal what the forward wrote for it

By induction over a tree's depth, equal K/V at every ancestor makes the copied keys exactly what plain
decoding along that path would have cached. Each row is labelled with the route it took (fused native
layers or module by module; row-wise or split attention; chain or tree; prefix or gathered keys; rows
and batch size), so a report says which path broke. The engine's own result is never changed.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from specfleet.runtime.model.attention import ROWWISE_ROWS
from specfleet.runtime.kv.cache import KVCache
from specfleet.runtime.step.runner import ForwardItem, ModelRunner
from specfleet.runtime.backends.native.forward import native_lib


@dataclass
class RowDiff:
    """One checked row that differs from its decode step."""

    request_id: str
    step: int
    row: int  # index among the item's new tokens
    token_id: int
    max_abs_logit: float  # max |row logits - decode logits|
    kv_equal: bool  # the K/V the forward wrote for the token equal the decode step's
    argmax_equal: bool
    route: str


@dataclass
class RowReport:
    """What a checked run saw: rows checked per route, and every row that differed."""

    rows_checked: int = 0
    steps_checked: int = 0
    routes: Counter = field(default_factory=Counter)
    diffs: list[RowDiff] = field(default_factory=list)

    @property
    def rows_differing(self) -> int:
        return len(self.diffs)

    def as_dict(self) -> dict:
        by_route = Counter(d.route for d in self.diffs)
        return {
            "rows_checked": self.rows_checked,
            "rows_differing": self.rows_differing,
            "steps_checked": self.steps_checked,
            "routes": dict(sorted(self.routes.items())),
            "differing_routes": dict(sorted(by_route.items())),
            "max_abs_logit_diff": max((d.max_abs_logit for d in self.diffs), default=0.0),
            "first_diffs": [d.__dict__ for d in self.diffs[:20]],
        }

    def merge(self, other: "RowReport") -> None:
        self.rows_checked += other.rows_checked
        self.steps_checked += other.steps_checked
        self.routes.update(other.routes)
        self.diffs.extend(other.diffs)


def _row_kind(item: ForwardItem, r: int, n_prefix: int) -> str:
    if len(item.token_ids) == 1:
        return "decode"
    if r < n_prefix:
        return "prompt-last" if n_prefix == len(item.token_ids) else "root"
    return "node"


def _visible_new(item: ForwardItem, r: int) -> list[int]:
    """The new tokens row r sees (itself last), in layout order."""
    mask = item.new_mask
    if mask is None:
        return list(range(r + 1))
    c = item.context_len
    mask = mask if isinstance(mask, np.ndarray) else mask.cpu().numpy()
    new = mask[r, c:] if mask.shape[1] == c + len(item.token_ids) else mask[r]
    return new[: r + 1].nonzero()[0].tolist()


@dataclass
class _Task:
    """One row to replay: its item, its row index, and the engine cache rows of its keys but its own."""

    item: ForwardItem
    row: int
    logits: torch.Tensor  # the row's logits from the checked forward
    key_slots: torch.Tensor  # [m] engine cache rows of the keys before it, in order
    own_slot: int  # engine cache row the forward wrote its K/V to
    route: str


class RowChecker:
    """Checks every logit row of every forward of one engine (see the module docstring): each row is
    replayed alone, a decode step of batch one."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.model = runner.model
        self.report = RowReport()
        self._scratch: ModelRunner | None = None
        self._step = 0
        self._execute = runner.execute

    @classmethod
    def attach(cls, engine) -> "RowChecker":
        """Wrap `engine`'s target runner; every later step is checked into `checker.report`."""
        checker = cls(engine.executor.runner)
        engine.executor.runner.execute = checker.execute
        return checker

    def detach(self) -> None:
        self.runner.execute = self._execute

    # -- the wrapped forward --------------------------------------------------------------------
    def execute(self, items: list[ForwardItem], blocks=None) -> torch.Tensor:
        logits = self._execute(items, blocks)
        self._step += 1
        self.report.steps_checked += 1
        path = self._path_label()
        tasks, row = [], 0
        for it in items:
            block_ids = it.block_ids if it.block_ids is not None else blocks.block_ids(it.request_id)
            n_rows = len(it.logit_indices)
            if n_rows and it.new_mask is not None and it.new_mask.shape[1] != len(it.token_ids):
                raise ValueError("rowcheck: items that hide part of their context are a draft's, not verification")
            tasks += self._tasks(it, block_ids, logits[row:row + n_rows], path, len(items))
            row += n_rows
        for t in tasks:
            self._replay([t])
        return logits

    def _path_label(self) -> str:
        """'native' when the model runs its decoder layers in C over the step's key plan, else 'module'."""
        if not self.model.runtime.fused_native or native_lib(self.model, torch.zeros(1, dtype=torch.long), self.runner.kv) is None:
            return "module"
        return "native"

    def _slots(self, block_ids: list[int], indices: list[int]) -> torch.Tensor:
        bs = self.runner.block_size
        return torch.tensor([block_ids[i // bs] * bs + i % bs for i in indices], dtype=torch.long,
                            device=self.runner.device)

    def _tasks(self, it: ForwardItem, block_ids: list[int], rows: torch.Tensor, path: str, batch: int) -> list[_Task]:
        c, n = it.context_len, len(it.token_ids)
        is_tree = it.new_mask is not None  # tree_item: a causal prefix whose last token is the root
        n_prefix = it.logit_indices[0] + 1 if is_tree and len(it.logit_indices) else n
        chain = not is_tree or bool(np.array_equal(np.asarray(it.new_mask)[:, -n:], np.tri(n, dtype=bool)))
        context = list(range(c))
        tasks = []
        for j, r in enumerate(it.logit_indices):
            seen = _visible_new(it, r)
            prefix = seen == list(range(r + 1))
            if path == "native":
                attn = "keyplan"
            else:
                attn = "rowwise" if n == 1 or (c and n <= ROWWISE_ROWS) else "split"
            route = (f"{path}/{attn}/{_row_kind(it, r, n_prefix)}/{'chain' if chain else 'tree'}"
                     f"/{'prefix' if prefix else 'gathered'}/rows={'1' if n == 1 else ('2-16' if n <= 16 else '17+')}"
                     f"/batch={'1' if batch == 1 else '2+'}")
            keys = self._slots(block_ids, context + [c + e for e in seen[:-1]])
            tasks.append(_Task(it, r, rows[j], keys, int(self._slots(block_ids, [c + r])[0]), route))
        return tasks

    def _scratch_runner(self, num_slots: int) -> ModelRunner:
        """A runner over a scratch KV cache of at least `num_slots` slots (grown as needed)."""
        kv = self.runner.kv
        have = 0 if self._scratch is None else self._scratch.kv.k[0].shape[0]
        if have < num_slots:
            bs = kv.block_size
            blocks = max((num_slots + bs - 1) // bs, 2 * have // bs)
            self._scratch = ModelRunner(self.model, KVCache.allocate(self.model.config, blocks, bs, kv.k[0].dtype,
                                                                     kv.k[0].device), self.runner.device,
                                        self.runner.vocab_limit)
        return self._scratch

    def _replay(self, tasks: list[_Task]) -> None:
        """One decode step over `tasks`, each row in a sequence of its own in the scratch cache (consecutive
        blocks, as the engine gives a request): its keys copied in, then its token decoded after them."""
        kv, bs = self.runner.kv, self.runner.block_size
        starts, total = [], 0
        for t in tasks:
            starts.append(total)
            total += (len(t.key_slots) + 1 + bs - 1) // bs * bs
        scratch = self._scratch_runner(total)
        src = torch.cat([t.key_slots for t in tasks])
        dst = torch.cat([torch.arange(s, s + len(t.key_slots)) for s, t in zip(starts, tasks)]).to(src.device)
        for layer in range(len(kv.k)):
            scratch.kv.k[layer].index_copy_(0, dst, kv.k[layer].index_select(0, src))
            scratch.kv.v[layer].index_copy_(0, dst, kv.v[layer].index_select(0, src))
        items = [ForwardItem(f"rowcheck-{i}", [t.item.token_ids[t.row]], len(t.key_slots), [0],
                             block_ids=list(range(s // bs, (s + len(t.key_slots) + 1 + bs - 1) // bs)))
                 for i, (s, t) in enumerate(zip(starts, tasks))]
        ref = scratch.execute(items)
        self._compare(tasks, ref, scratch.kv, [s + len(t.key_slots) for s, t in zip(starts, tasks)])

    def _compare(self, tasks: list[_Task], ref: torch.Tensor, kv: KVCache, written: list[int]) -> None:
        """Each task's logits and K/V against its replay's (`ref` rows; the replay wrote K/V at `written`)."""
        own = self.runner.kv
        for i, (t, m) in enumerate(zip(tasks, written)):
            kv_equal = all(torch.equal(own.k[layer][t.own_slot], kv.k[layer][m])
                           and torch.equal(own.v[layer][t.own_slot], kv.v[layer][m])
                           for layer in range(len(own.k)))
            self.report.rows_checked += 1
            self.report.routes[t.route] += 1
            if torch.equal(t.logits, ref[i]) and kv_equal:
                continue
            self.report.diffs.append(RowDiff(t.item.request_id, self._step, t.row, t.item.token_ids[t.row],
                                             float((t.logits - ref[i]).abs().max()), kv_equal,
                                             int(t.logits.argmax()) == int(ref[i].argmax()), t.route))


def run_unchecked(engine, prompts: list[list[int]], params) -> list:
    """Run `prompts` to completion on `engine`: the outputs in prompt order (no rows checked)."""
    reqs = [engine.add_request(p, params) for p in prompts]
    order = {r.request_id: i for i, r in enumerate(reqs)}
    outs: list = [None] * len(reqs)
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished and o.request_id in order:
                outs[order[o.request_id]] = o
    return outs


def check_engine_run(engine, prompts: list[list[int]], params) -> tuple[list, RowReport]:
    """Run `prompts` to completion on `engine` with every row checked: (outputs in prompt order, report)."""
    checker = RowChecker.attach(engine)
    try:
        outs = run_unchecked(engine, prompts, params)
    finally:
        checker.detach()
    return outs, checker.report


