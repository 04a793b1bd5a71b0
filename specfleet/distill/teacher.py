"""The target's next-token distribution for the KL term: top-k per loss position, computed on the
fly each step ("online", exact but a target forward per step) or once per example and cached
("cache", one target forward per example, saved beside the continuations so a resumed run reuses it).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specfleet.distill.data import Sequence, collate, make_batches
from specfleet.distill.student import causal_forward


@dataclass
class TeacherTopK:
    """The target's top-k next-token distribution at the loss positions of a batch, row-major."""

    token_ids: torch.Tensor  # [N, k] int64
    logprobs: torch.Tensor  # [N, k] float, log-probabilities under the full vocabulary


@torch.no_grad()
def teacher_topk(teacher, input_ids: torch.Tensor, mask: torch.Tensor, k: int) -> TeacherTopK:
    """Top-k of the teacher (a runtime DecoderLM) at the masked positions of [B, T] `input_ids`."""
    hidden = causal_forward(teacher, input_ids)[mask]  # [N, hidden]
    ids, values = [], []
    for chunk in hidden.split(256):  # bounds the [rows, vocab] logits held at once
        logp = torch.log_softmax(teacher.compute_logits(chunk).float(), dim=-1)
        top = logp.topk(k, dim=-1)
        ids.append(top.indices)
        values.append(top.values)
    return TeacherTopK(torch.cat(ids), torch.cat(values))


class TopKCache:
    """Per-sequence teacher top-k rows: {sequence id: (token_ids int32 [n, k], logprobs fp16 [n, k])}."""

    def __init__(self, path: Path, k: int):
        self.path, self.k = path, k
        self.rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            if saved["k"] == k:
                self.rows = saved["rows"]

    def fill(self, load_teacher, seqs: list[Sequence], batch_tokens: int, save_every: int = 8) -> None:
        """Compute the rows of every sequence not cached yet (or cached for another truncation);
        `load_teacher()` gives the teacher, and is not called when nothing is missing."""
        todo = [s for s in seqs if s.id not in self.rows or len(self.rows[s.id][0]) != s.num_targets]
        if not todo:
            return
        teacher = load_teacher()
        batches = make_batches(todo, batch_tokens, seed=0, epoch=0)
        for n, batch in enumerate(tqdm(batches, desc="target top-k", unit="batch")):
            group = [todo[i] for i in batch]
            ids, _, mask = collate(group)
            top = teacher_topk(teacher, ids, mask, self.k)
            sizes = [s.num_targets for s in group]
            for s, t, v in zip(group, top.token_ids.split(sizes), top.logprobs.split(sizes)):
                self.rows[s.id] = (t.int(), v.half())
            if (n + 1) % save_every == 0:
                self.save()
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save({"k": self.k, "rows": self.rows}, tmp)
        tmp.replace(self.path)

    def lookup(self, seqs: list[Sequence]) -> TeacherTopK:
        """Rows of `seqs` in the row-major order in which collate()'s mask selects positions."""
        rows = [self.rows[s.id] for s in seqs]
        return TeacherTopK(torch.cat([r[0] for r in rows]).long(), torch.cat([r[1] for r in rows]).float())
