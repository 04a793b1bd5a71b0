"""The distillation loss: next-token cross-entropy on the target's greedy tokens, plus an optional
KL(target || draft) on the target's top-k distribution.

Both terms are measured against the *exported* draft's full-vocabulary distribution (see
student.py): an out-of-set token j has log-probability log q_other - log(V - K), because the pooled
class spreads evenly over V - K zero logits. The top-k teacher distribution is renormalised over its
k tokens (the usual truncated-KD choice; k = 32 keeps > 95 % of a confident model's mass).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specfleet.distill.student import Student, causal_forward
from specfleet.distill.teacher import TeacherTopK


def token_logprobs(student: Student, log_q: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exported-model log-probabilities of `token_ids` [N, k] from class log-probs `log_q` [N, C]."""
    classes = student.class_of[token_ids]
    lp = log_q.gather(1, classes)
    if student.is_reduced:
        lp = lp - torch.where(classes == student.head.shape[0], student.other_logit, 0.0)
    return lp


@dataclass
class LossParts:
    loss: torch.Tensor  # what is minimised: ce + kl_weight * kl
    ce: float
    kl: float
    num_tokens: int
    num_correct: int  # greedy top-1 agreements with the target's token


def distill_loss(student: Student, input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                 teacher: TeacherTopK | None = None, kl_weight: float = 0.0, teacher_labels: bool = False) -> LossParts:
    """`labels` are the next tokens; with `teacher_labels` the teacher's argmax replaces them (the same
    tokens on greedy continuations, the target's choice on prompt text)."""
    hidden = causal_forward(student.body, input_ids)[mask]  # [N, hidden], loss positions only
    logits = student.class_logits(hidden)  # [N, C]
    log_q = torch.log_softmax(logits.float(), dim=-1)
    target = teacher.token_ids[:, 0] if teacher_labels else labels[mask]  # [N] token ids; top-k is sorted
    ce = -token_logprobs(student, log_q, target[:, None]).mean()
    kl = torch.zeros(())
    if teacher is not None and kl_weight > 0:
        p = torch.softmax(teacher.logprobs.float(), dim=-1)  # renormalised over the top k
        lp = torch.log(p.clamp_min(1e-12))
        kl = (p * (lp - token_logprobs(student, log_q, teacher.token_ids))).sum(-1).mean()
    correct = int(student.greedy_correct(logits.detach(), student.class_of[target]).sum())
    return LossParts(ce + kl_weight * kl, ce.item(), kl.item(), int(target.numel()), correct)
