"""Training a feature-conditioned draft head (drafting/head.py) on features from distill/head_data.py.

Row j of a window reads (f_j, t_{j+1}) and is trained to give the target's greedy token y_{j+1}
(cross-entropy over the reduced vocabulary) and its feature f_{j+1} (smooth L1). With `depth` > 1
the head is also trained as it drafts deeper tokens (EAGLE-3's training-time test): pass m reads the
features pass m-1 predicted (FeatureHead.forward_passes).

Training runs for a time budget (the learning rate follows the budget's elapsed fraction), with a
progress bar and ETA, saves its state every few minutes and at the end (`--resume` continues it), and
every `eval_every_s` measures acceptance on an evaluation set (HumanEval prompts with the target's
greedy continuations, never trained on) into curve.jsonl: the learning curve.
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specfleet.distill.head_data import load_shards
from specfleet.drafting.head import FeatureHead, HeadConfig, init_from_target, target_embed


@dataclass
class TrainConfig:
    draft_vocab: int = 16384
    intermediate: int | None = 4096
    lr: float = 5e-4
    batch_windows: int = 8
    max_len: int = 512
    depth: int = 2  # training-time-test passes
    depth_weight: float = 0.5  # weight of passes after the first
    reg_weight: float = 0.5  # smooth L1 on the predicted feature
    noise: float = 0.05  # uniform noise on the input features
    # cross-entropy over the batch's labels and the `candidates` most frequent draft tokens instead of the
    # whole reduced vocabulary: the head's rows are frozen (the target's), so this ranks the label above
    # every likely rival at a tenth of the product's cost; 0 = the full reduced vocabulary
    candidates: int = 2048
    time_budget_s: float = 600.0
    warmup_steps: int = 10
    max_steps: int | None = None  # also stop after this many steps (the schedule follows whichever ends first)
    eval_every_s: float = 300.0
    save_every_s: float = 300.0
    seed: int = 0
    max_train_tokens: int | None = None  # use only the first shards (learning curves over data size)
    device: str = "cpu"
    ls_init: float | None = 1e-4  # start fc as the ridge-regression fit (this relative ridge), None: random
    grow_data: bool = False  # reread the feature folder after every epoch (an extraction still running adds to it)


def draft_vocabulary(labels: torch.Tensor, tokens: torch.Tensor, size: int, vocab_size: int,
                     extra_counts: Counter | None = None) -> torch.Tensor:
    """The `size` most frequent target tokens (labels count double: they are what the head predicts)."""
    counts = torch.bincount(labels.long(), minlength=vocab_size).double() * 2
    counts += torch.bincount(tokens.long(), minlength=vocab_size).double()
    if extra_counts:
        ids = torch.tensor(list(extra_counts.keys()), dtype=torch.long)
        extra = torch.tensor(list(extra_counts.values()), dtype=torch.double)
        # as a share of the feature tokens' total, so the larger corpus decides where the features are thin
        counts.index_add_(0, ids, extra * (float(counts.sum()) / float(extra.sum())))
    counts += torch.linspace(1e-6, 0, vocab_size, dtype=torch.double)  # ties: lower ids (earlier merges) first
    size = min(size, vocab_size)
    return torch.topk(counts, size).indices.sort().values


class Windows:
    """The windows of a feature set, as padded training batches."""

    def __init__(self, data: dict[str, torch.Tensor], reduced_of: torch.Tensor):
        self.d = data
        self.reduced_of = reduced_of  # target id -> reduced index, -100 where absent
        lengths = data["lengths"].tolist()
        self.offsets = [0]
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, ids: list[int], target, max_len: int, device: str = "cpu"):
        """emb, feats [B, T, H], target features [B, T, H], labels [B, T] (reduced ids or -100)."""
        t = min(max_len, max(self.lengths[i] for i in ids)) - 1
        h = self.d["feats"].shape[1]
        b = len(ids)
        feats = torch.zeros(b, t, h)
        nxt = torch.zeros(b, t, h)
        toks = torch.zeros(b, t, dtype=torch.long)
        labels = torch.full((b, t), -100, dtype=torch.long)
        for r, i in enumerate(ids):
            a = self.offsets[i]
            n = min(self.lengths[i], t + 1)
            f = self.d["feats"][a:a + n].float()
            feats[r, :n - 1] = f[:-1]
            nxt[r, :n - 1] = f[1:]
            toks[r, :n - 1] = self.d["tokens"][a + 1:a + n].long()
            labels[r, :n - 1] = self.reduced_of[self.d["labels"][a + 1:a + n].long()]
        emb = target_embed(target, toks.flatten()).view(b, t, h)
        return emb.to(device), feats.to(device), nxt.to(device), labels.to(device)


@torch.no_grad()
def fit_fc_least_squares(head: FeatureHead, target, windows: "Windows", ids: list[int], ridge: float = 1e-4) -> None:
    """Set fc to the ridge-regression map from [embed(t_{j+1}), f_j] to f_{j+1} / final_norm.weight (the
    input that final_norm turns into f_{j+1}), so the head with its layer still a no-op is the best
    linear next-feature predictor on these windows. One solve: on SmolLM2 features it matched 60 steps of
    gradient descent from a random fc (first-token accuracy 0.26 vs 0.22)."""
    h = head.config.hidden_size
    ztz = torch.zeros(2 * h, 2 * h, dtype=torch.float64)
    zty = torch.zeros(2 * h, h, dtype=torch.float64)
    scale = head.final_norm.weight.detach().float()
    scale = torch.where(scale.abs() < 1e-6, torch.full_like(scale, 1e-6), scale)
    n = 0
    for i in ids:
        emb, feats, nxt, labels = windows.batch([i], target, 10 ** 9)
        z = torch.cat([emb[0], feats[0]], -1)
        y = nxt[0] / scale
        ztz += (z.T @ z).double()
        zty += (z.T @ y).double()
        n += z.shape[0]
    reg = ridge * float(ztz.diagonal().mean())
    w = torch.linalg.solve(ztz + reg * torch.eye(2 * h, dtype=torch.float64), zty).T
    head.fc.weight.copy_(w.float())


def losses(head: FeatureHead, emb, feats, nxt, labels, cfg: TrainConfig, depth: int | None = None,
           frequent: torch.Tensor | None = None):
    rows = None
    if cfg.candidates and frequent is not None and cfg.candidates < head.config.draft_vocab:
        present = labels[labels != -100].unique()
        rows = torch.cat([frequent[:cfg.candidates].to(labels.device), present]).unique()
        remap = torch.full((head.config.draft_vocab,), -100, dtype=torch.long, device=labels.device)
        remap[rows] = torch.arange(rows.numel(), device=labels.device)
        labels = torch.where(labels != -100, remap[labels.clamp_min(0)], labels)
    outs = head.forward_passes(emb, feats, depth or cfg.depth, cfg.noise if head.training else 0.0, rows)
    total, parts = 0.0, []
    valid = labels != -100
    for m, (f, logits) in enumerate(outs, start=1):
        lab = labels.clone()
        lab[:, :m - 1] = -100  # rows before m - 1 have no predicted input in pass m
        ce = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100)
        mask = valid.clone()
        mask[:, :m - 1] = False
        reg = F.smooth_l1_loss(f[mask], nxt[mask]) if mask.any() else f.sum() * 0
        w = 1.0 if m == 1 else cfg.depth_weight
        total = total + w * (ce + cfg.reg_weight * reg)
        parts.append((float(ce.detach()), float(reg.detach())))
    return total, parts


@torch.no_grad()
def evaluate(head: FeatureHead, target, eval_data: dict, starts: list[int], max_depth: int = 4) -> dict:
    """Chain acceptance on an evaluation set of prompt + greedy continuation windows: for every drafting
    point N of a continuation (t_N the last committed token), whether the head's m-th drafted token is
    the target's greedy token, given that the first m - 1 were: `acc[m]` = P(m accepted | m - 1 accepted),
    `mean_accepted` = E[accepted tokens of a 4-token chain]."""
    was = head.training
    head.eval()
    offsets = [0] + eval_data["lengths"].cumsum(0).tolist()
    hits = [0] * (max_depth + 1)
    points = 0
    for w, p in enumerate(starts):
        a, b = offsets[w], offsets[w + 1]
        n = b - a
        toks, labels = eval_data["tokens"][a:b].long(), eval_data["labels"][a:b].long()
        feats = eval_data["feats"][a:b].float()
        emb = target_embed(target, toks[1:]).unsqueeze(0)
        outs = head.forward_passes(emb, feats[:-1].unsqueeze(0), max_depth)
        preds = [head.token_map[o[1][0].argmax(-1)] for o in outs]  # pass m, row j: the guess for y_{j+1}
        for big_n in range(p, n):
            points += 1
            ok = True
            for m in range(1, max_depth + 1):
                j = big_n + m - 2
                if j + 1 >= n:
                    ok = False
                ok = ok and bool(preds[m - 1][j] == labels[j + 1])
                if not ok:
                    break
                hits[m] += 1
    head.train(was)
    hits[0] = points
    acc = {m: hits[m] / max(1, hits[m - 1]) for m in range(1, max_depth + 1)}
    return {"points": points, "acc": acc, "mean_accepted": sum(hits[1:]) / max(1, points)}


def train(target, data_dir: Path, out: Path, cfg: TrainConfig, eval_dir: Path | None = None, resume: bool = False,
          extra_counts: Counter | None = None, progress: bool = True, log=print) -> FeatureHead:
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    data = load_shards(data_dir, cfg.max_train_tokens)
    n_tokens = int(data["lengths"].sum())
    n_shards = len(json.loads((data_dir / "manifest.json").read_text())["shards"])
    vocab = target.config.vocab_size
    state_path = out / "train_state.pt"
    # weights_only: a state file holds tensors, numbers and plain dicts, never code to run (torch.load's
    # pickles could); the head's config is stored as a dict for that reason
    state = torch.load(state_path, weights_only=True) if resume and state_path.is_file() else None
    if state is not None:
        head = FeatureHead(HeadConfig.from_dict(state["head_config"]))
        head.load_state_dict(state["head"])
    else:
        ids = draft_vocabulary(data["labels"], data["tokens"], cfg.draft_vocab, vocab, extra_counts)
        head = init_from_target(target, ids, cfg.intermediate)
    windows_all = None
    if state is None and cfg.ls_init is not None:
        ro = torch.full((vocab,), -100, dtype=torch.long)
        ro[head.token_map] = torch.arange(head.token_map.numel())
        windows_all = Windows(data, ro)
        fit_fc_least_squares(head, target, windows_all, list(range(len(windows_all))), cfg.ls_init)
    head.to(cfg.device).train()
    head.lm.weight.requires_grad_(False)  # the target's own head rows: the features' meaning stays the target's
    reduced_of = torch.full((vocab,), -100, dtype=torch.long)
    reduced_of[head.token_map.cpu()] = torch.arange(head.token_map.numel())
    covered = float((reduced_of[data["labels"].long()] >= 0).float().mean())
    lab = reduced_of[data["labels"].long()]
    frequent = torch.argsort(torch.bincount(lab[lab >= 0], minlength=head.config.draft_vocab).double()
                             + torch.linspace(1e-3, 0, head.config.draft_vocab, dtype=torch.double), descending=True)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, seen, elapsed = 0, 0, 0.0
    if state is not None:
        opt.load_state_dict(state["opt"])
        step, seen, elapsed = state["step"], state["seen"], state["elapsed"]
    windows = Windows(data, reduced_of)
    eval_data, starts = None, None
    if eval_dir is not None and (eval_dir / "manifest.json").is_file():
        eval_data = load_shards(eval_dir)
        starts = json.loads((eval_dir / "manifest.json").read_text())["continuation_starts"]
    curve = out / "curve.jsonl"
    log(f"training a draft head on {n_tokens} feature tokens ({len(windows)} windows); draft vocabulary "
        f"{head.config.draft_vocab} covers {covered:.1%} of the target's greedy tokens; budget {cfg.time_budget_s:.0f} s")
    g = torch.Generator().manual_seed(cfg.seed + step)
    order: list[int] = []

    def save() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "head_config": asdict(head.config), "opt": opt.state_dict(), "step": step,
                    "seen": seen, "elapsed": elapsed, "config": asdict(cfg), "data_tokens": n_tokens}, tmp)
        tmp.replace(state_path)

    def run_eval() -> None:
        if eval_data is None:
            return
        r = evaluate(head, target, eval_data, starts, max_depth=3)
        rec = {"step": step, "tokens_seen": seen, "data_tokens": n_tokens, "epochs": seen / max(1, n_tokens),
               "train_s": round(elapsed, 1), **r}
        with open(curve, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log(f"eval @ {seen} tokens seen ({elapsed / 60:.1f} min): acceptance by position "
            + ", ".join(f"{v:.3f}" for v in r["acc"].values()) + f"; mean accepted of a 3-token chain: {r['mean_accepted']:.2f}")

    bar = tqdm(total=int(cfg.time_budget_s), initial=int(min(elapsed, cfg.time_budget_s)), unit="s", desc="head",
               disable=not progress, file=sys.stderr, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s [{elapsed}<{remaining}{postfix}]")
    t_last = time.perf_counter()
    last_eval = last_save = elapsed
    if state is None:
        run_eval()
    warmup = cfg.warmup_steps if cfg.max_steps is None else max(1, min(cfg.warmup_steps, cfg.max_steps // 10))
    while elapsed < cfg.time_budget_s and (cfg.max_steps is None or step < cfg.max_steps):
        if not order:
            if cfg.grow_data and cfg.max_train_tokens is None:
                shards = len(json.loads((data_dir / "manifest.json").read_text())["shards"])
                if shards > n_shards:
                    data, n_shards = load_shards(data_dir), shards
                    n_tokens = int(data["lengths"].sum())
                    windows = Windows(data, reduced_of)
                    log(f"now {n_tokens} feature tokens ({len(windows)} windows)")
            order = torch.randperm(len(windows), generator=g).tolist()
        ids, order = order[:cfg.batch_windows], order[cfg.batch_windows:]
        emb, feats, nxt, labels = windows.batch(ids, target, cfg.max_len, cfg.device)
        frac = max(elapsed / cfg.time_budget_s, 0.0 if cfg.max_steps is None else step / cfg.max_steps)
        lr = cfg.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for pg in opt.param_groups:
            pg["lr"] = lr
        loss, parts = losses(head, emb, feats, nxt, labels, cfg, frequent=frequent)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += int((labels != -100).sum())
        now = time.perf_counter()
        elapsed += now - t_last
        t_last = now
        bar.n = int(min(elapsed, cfg.time_budget_s))
        bar.set_postfix_str(f"ce {parts[0][0]:.3f} reg {parts[0][1]:.3f} tok {seen}")
        bar.refresh()
        if elapsed - last_save >= cfg.save_every_s:
            save()
            last_save = elapsed
        if elapsed - last_eval >= cfg.eval_every_s:
            run_eval()
            last_eval = elapsed
            t_last = time.perf_counter()  # evaluation time is not training time
    bar.close()
    save()
    run_eval()
    return head.eval()
