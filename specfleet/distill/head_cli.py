"""`specfleet draft train`: build the feature-conditioned draft head (`--draft head`) for a target.

    specfleet draft train --target qwen-1.5b --feature-tokens 200000 --extract-minutes 60 --minutes 90

Steps, each resumable (rerun the same command; `--resume` continues the training state):
1. features: the target's final hidden states and greedy tokens on offline text (the standard library's
   Python sources and ShareGPT conversations outside the benchmark's draw; distill/head_data.py), fp16
   shards under DATA (default: beside the head in the cache);
2. an evaluation set: the first HumanEval prompts with the target's greedy continuations (evaluation
   only, never trained on), for the learning curve (DATA/curve.jsonl);
3. training for `--minutes` (distill/head_train.py), then the head is written where `head` finds it:
   `cache_root()/heads/<target file>-<key>/head.pt`, with the target file's sha256.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_draft_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("draft", help="build drafts for a target (the feature-conditioned draft head)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="draft_command", required=True)
    t = sub.add_parser("train", help="extract features and train the draft head for a target",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="registered name or .gguf file")
    t.add_argument("--data", default=None, help="feature folder (default: beside the head in the cache)")
    t.add_argument("--out", default=None, help="head file (default: the cache, where `head` finds it)")
    t.add_argument("--feature-tokens", type=int, default=200_000, help="tokens of features to extract")
    t.add_argument("--extract-minutes", type=float, default=None, help="stop extracting after this long")
    t.add_argument("--minutes", type=float, default=90.0, help="training budget (all resumes together)")
    t.add_argument("--resume", action="store_true", help="continue the training state in DATA/run")
    t.add_argument("--device", default="cpu", help="cpu | cuda (training only; features come from the CPU runtime)")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    t.add_argument("--draft-vocab", type=int, default=16384, help="rows of the head's reduced vocabulary")
    t.add_argument("--vocab-files", type=int, default=None,
                   help="standard-library files tokenized to choose the reduced vocabulary (default: all)")
    t.add_argument("--intermediate", type=int, default=2048, help="MLP width of the head's layer")
    t.add_argument("--depth", type=int, default=1,
                   help="training-time-test passes (2: also trained on its own predicted features, at twice the cost)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-windows", type=int, default=1,
                   help="windows (of up to 512 tokens) per optimizer step: on a CPU few steps happen at all, so small")
    t.add_argument("--eval-prompts", type=int, default=20, help="HumanEval prompts of the evaluation set (0: none)")
    t.add_argument("--eval-every-min", type=float, default=8.0)
    t.add_argument("--candidates", type=int, default=2048,
                   help="training's softmax: the batch's labels and this many most frequent tokens (0: all)")
    t.add_argument("--ls-init", type=float, default=1e-4,
                   help="start fc as a ridge-regression fit with this relative ridge (negative: random start)")
    t.add_argument("--grow-data", action="store_true",
                   help="reread DATA after every epoch (an extraction running beside training adds to it)")
    t.set_defaults(func=run_draft_train)
    return p


def run_draft_train(args) -> int:
    import torch

    from specfleet.distill.head_data import extract, humaneval_eval_set
    from specfleet.distill.head_train import TrainConfig, train
    from specfleet.drafting.head import head_path, save_head, target_sha256
    from specfleet.registry import resolve_model
    from specfleet.runtime.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.target)
    out = Path(args.out) if args.out else head_path(path)
    data = Path(args.data) if args.data else out.parent / "data"
    model, tok = load_model(str(path), torch.float32, torch.device("cpu"), quantization="auto")
    t0 = time.perf_counter()
    if args.eval_prompts:
        humaneval_eval_set(model, tok, data / "eval-humaneval", args.eval_prompts)
    budget = None if args.extract_minutes is None else args.extract_minutes * 60
    manifest = extract(model, tok, data / "train", args.feature_tokens, time_budget_s=budget)
    print(f"features: {manifest['tokens']} tokens in {manifest['seconds'] / 60:.1f} min of extraction")
    cfg = TrainConfig(draft_vocab=args.draft_vocab, intermediate=args.intermediate, lr=args.lr,
                      batch_windows=args.batch_windows, depth=args.depth, time_budget_s=args.minutes * 60,
                      eval_every_s=args.eval_every_min * 60, device=args.device, candidates=args.candidates,
                      grow_data=args.grow_data, ls_init=None if args.ls_init < 0 else args.ls_init)
    from specfleet.distill.head_data import token_counts

    counts = None if args.resume else token_counts(tok, args.vocab_files)
    head = train(model, data / "train", data / "run", cfg, eval_dir=data / "eval-humaneval" if args.eval_prompts else None,
                 resume=args.resume, extra_counts=counts)
    curve = data / "run" / "curve.jsonl"
    last = json.loads(curve.read_text().splitlines()[-1]) if curve.is_file() else {}
    meta = {"feature_tokens": manifest["tokens"], "extract_minutes": round(manifest["seconds"] / 60, 1),
            "train_minutes": args.minutes, "eval": last, "wall_minutes": round((time.perf_counter() - t0) / 60, 1)}
    save_head(head.cpu(), out, target_sha256(path), meta)
    print(f"draft head written to {out}: {json.dumps(meta)}")
    print("use it with --draft head (alone) or e.g. --draft 'fleet(head,suffix,prompt-lookup)'")
    return 0
