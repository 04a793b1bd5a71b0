"""The training loop: AdamW under a wall-clock budget, with periodic checkpoints and resumption.

A checkpoint (`train_state.pt`) holds only what training changes: the trainable tensors, the
optimizer, the data position (epoch, batch) and the clock. Frozen tensors (the 151,936-row embedding
table by default) are rebuilt from the same source on resume, which keeps checkpoints small; the
student's spec and vocabulary are stored so a resume with other settings is refused, not mixed.

The learning rate warms up linearly, then follows a cosine to `min_lr_frac` of its peak over the
run's progress: the larger of steps / max_steps and elapsed / time budget, so a time-limited run
decays on schedule however fast the machine is.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from specfleet.distill.data import Sequence, collate, make_batches
from specfleet.distill.losses import distill_loss
from specfleet.distill.student import Student
from specfleet.distill.teacher import TeacherTopK
from specfleet.errors import SpecfleetError

STATE_FILE = "train_state.pt"
TeacherFn = Callable[[list[Sequence], torch.Tensor, torch.Tensor], TeacherTopK]


@dataclass
class TrainConfig:
    lr: float = 3e-4
    min_lr_frac: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_tokens: int = 4096  # padded tokens per step
    max_steps: int | None = None
    time_budget_s: float = 3600.0
    checkpoint_every_s: float = 300.0  # also when held-out figures are recorded
    kl_weight: float = 0.0
    teacher_labels: bool = False  # next-token labels from the teacher's argmax (prompt positions too)
    seed: int = 0


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_index: int = 0  # next batch of `epoch`
    elapsed_s: float = 0.0  # training wall-clock over all runs, evaluations included
    history: list[dict] = field(default_factory=list)


def read_checkpoint(out_dir: Path) -> dict | None:
    path = out_dir / STATE_FILE
    return torch.load(path, weights_only=True) if path.is_file() else None


def check_compatible(saved: dict, student: Student) -> None:
    if saved["spec"] != student.spec.as_dict():
        diff = {k: (saved["spec"].get(k), v) for k, v in student.spec.as_dict().items() if saved["spec"].get(k) != v}
        raise SpecfleetError(f"the checkpoint in this --out was trained with other settings {diff} (saved, now); "
                             "rerun with the original settings or choose another --out")


class Trainer:
    def __init__(self, student: Student, train: list[Sequence], heldout: list[Sequence], cfg: TrainConfig,
                 out_dir: Path, teacher: TeacherFn | None = None):
        if not train:
            raise SpecfleetError("no training sequences: every continuation was empty")
        if teacher is None and (cfg.kl_weight > 0 or cfg.teacher_labels):
            raise SpecfleetError("a KL term or teacher labels need the teacher's top-k")
        self.student, self.train_seqs, self.heldout, self.cfg = student, train, heldout, cfg
        self.out_dir, self.teacher = out_dir, teacher
        self.params = [p for p in student.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.state = TrainState()
        self._since = {"loss": 0.0, "tokens": 0, "correct": 0}

    # -- checkpoints -----------------------------------------------------------------------------
    def load(self, saved: dict) -> None:
        check_compatible(saved, self.student)
        own = dict(self.student.named_parameters())
        with torch.no_grad():
            for name, t in saved["weights"].items():
                own[name].copy_(t)
        self.opt.load_state_dict(saved["optimizer"])
        self.state = TrainState(**saved["state"])

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"spec": self.student.spec.as_dict(), "vocab_ids": self.student.vocab_ids,
                   "weights": self.student.trainable_state(), "optimizer": self.opt.state_dict(),
                   "state": asdict(self.state), "config": asdict(self.cfg)}
        tmp = self.out_dir / (STATE_FILE + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(self.out_dir / STATE_FILE)  # atomic: a crash never leaves half a checkpoint

    # -- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Teacher-forced cross-entropy and greedy top-1 agreement on the held-out continuations."""
        total, tokens, correct = 0.0, 0, 0
        for batch in make_batches(self.heldout, self.cfg.batch_tokens, 0, 0):
            parts = distill_loss(self.student, *collate([self.heldout[i] for i in batch]))
            total += parts.ce * parts.num_tokens
            tokens += parts.num_tokens
            correct += parts.num_correct
        return {"heldout_loss": total / max(1, tokens), "heldout_agreement": correct / max(1, tokens),
                "heldout_tokens": tokens}

    def _record(self) -> None:
        s = self._since
        entry = {"step": self.state.step, "elapsed_s": round(self.state.elapsed_s, 1)}
        if s["tokens"]:
            entry |= {"train_loss": s["loss"] / s["tokens"], "train_agreement": s["correct"] / s["tokens"]}
        entry |= self.evaluate() if self.heldout else {}
        self.state.history.append(entry)
        self._since = {"loss": 0.0, "tokens": 0, "correct": 0}

    # -- the loop --------------------------------------------------------------------------------
    def _lr(self) -> float:
        c, s = self.cfg, self.state
        progress = s.elapsed_s / c.time_budget_s
        if c.max_steps:
            progress = max(progress, s.step / c.max_steps)
        warm = min(1.0, (s.step + 1) / max(1, c.warmup_steps))
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return c.lr * warm * (c.min_lr_frac + (1 - c.min_lr_frac) * cosine)

    def _is_done(self) -> bool:
        c, s = self.cfg, self.state
        return s.elapsed_s >= c.time_budget_s or (c.max_steps is not None and s.step >= c.max_steps)

    def _train_step(self, seqs: list[Sequence]) -> None:
        ids, labels, mask = collate(seqs)
        c = self.cfg
        needs_teacher = c.kl_weight > 0 or c.teacher_labels
        teacher = self.teacher(seqs, ids, mask) if needs_teacher else None
        for group in self.opt.param_groups:
            group["lr"] = self._lr()
        parts = distill_loss(self.student, ids, labels, mask, teacher, c.kl_weight, c.teacher_labels)
        parts.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._since["loss"] += parts.ce * parts.num_tokens
        self._since["tokens"] += parts.num_tokens
        self._since["correct"] += parts.num_correct

    def run(self) -> TrainState:
        """Train until the time budget or max_steps; checkpoints on the way and at the end."""
        st, cfg = self.state, self.cfg
        if not st.history:
            self._record()  # the untrained student, for the report's before/after
        if self._is_done():
            return st
        self.student.train()
        base, t0, last_save = st.elapsed_s, time.perf_counter(), time.perf_counter()
        # a step-limited run shows steps; a time-limited one shows seconds of its budget
        bar = tqdm(total=cfg.max_steps, initial=st.step, unit="step", desc="distill") if cfg.max_steps else \
            tqdm(total=round(cfg.time_budget_s), initial=round(min(base, cfg.time_budget_s)), unit="s", desc="distill")
        while not self._is_done():
            batches = make_batches(self.train_seqs, cfg.batch_tokens, cfg.seed, st.epoch)
            while st.batch_index < len(batches) and not self._is_done():
                self._train_step([self.train_seqs[i] for i in batches[st.batch_index]])
                st.batch_index += 1
                st.step += 1
                now = time.perf_counter()
                st.elapsed_s = base + now - t0
                bar.update(1 if cfg.max_steps else round(min(st.elapsed_s, cfg.time_budget_s)) - bar.n)
                s = self._since
                bar.set_postfix_str(f"step {st.step}, epoch {st.epoch}, loss {s['loss'] / max(1, s['tokens']):.3f}")
                if now - last_save >= cfg.checkpoint_every_s:
                    self._record()
                    self.save()
                    last_save = time.perf_counter()
            if st.batch_index >= len(batches):
                st.epoch, st.batch_index = st.epoch + 1, 0
        bar.close()
        self.student.eval()
        self._record()
        self.save()
        return st
