"""The draft head's learning curve over data size, at the cost of a solve per point.

    PYTHONPATH=. python tools/head_learning_curve.py --target qwen-1.5b --data DATA [--head FILE]

For growing shares of the feature windows in DATA/train (in their stored order), fits the head's fc
by ridge regression (distill/head_train.fit_fc_least_squares; the layer a no-op: the linear head a
trained run starts from) and measures acceptance on DATA/eval-humaneval (HumanEval prompts with the
target's greedy continuations, never trained on). With --head, also the trained head's figures and the
coverage of the evaluation's greedy tokens by its reduced vocabulary.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen-1.5b")
    ap.add_argument("--data", required=True)
    ap.add_argument("--head", default=None)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0])
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--ridge", type=float, default=1e-4)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specfleet.distill.head_data import load_shards
    from specfleet.distill.head_train import Windows, draft_vocabulary, evaluate, fit_fc_least_squares
    from specfleet.drafting.head import init_from_target, load_head
    from specfleet.runtime.loading.load import load_model

    data_dir = Path(args.data)
    model, _ = load_model(args.target, torch.float32, torch.device("cpu"), quantization="auto")
    data = load_shards(data_dir / "train")
    ev = load_shards(data_dir / "eval-humaneval")
    starts = json.loads((data_dir / "eval-humaneval" / "manifest.json").read_text())["continuation_starts"]
    vocab = model.config.vocab_size
    if args.head:
        head, meta = load_head(Path(args.head))
        ids = head.token_map.clone()
    else:
        head, meta, ids = None, {}, draft_vocabulary(data["labels"], data["tokens"], args.draft_vocab, vocab)
    reduced_of = torch.full((vocab,), -100, dtype=torch.long)
    reduced_of[ids] = torch.arange(ids.numel())
    offsets = [0] + data["lengths"].cumsum(0).tolist()
    cont = torch.cat([ev["labels"][o + s:o + n] for o, s, n in zip(
        [0] + ev["lengths"].cumsum(0).tolist()[:-1], starts, ev["lengths"].tolist())]).long()
    print(json.dumps({"eval_greedy_tokens": int(cont.numel()),
                      "coverage_of_eval_greedy_tokens": round(float((reduced_of[cont] >= 0).float().mean()), 4),
                      "feature_tokens": offsets[-1], "windows": len(offsets) - 1}), flush=True)
    windows = Windows(data, reduced_of)
    for frac in args.fractions:
        k = max(1, round(frac * len(windows)))
        lin = init_from_target(model, ids, 256)
        fit_fc_least_squares(lin, model, windows, list(range(k)), args.ridge)
        r = evaluate(lin, model, ev, starts, max_depth=args.depth)
        print(json.dumps({"kind": "linear (ridge fc, no layer)", "windows": k, "tokens": offsets[k],
                          "acc": {m: round(v, 4) for m, v in r["acc"].items()},
                          "mean_accepted": round(r["mean_accepted"], 4)}), flush=True)
    if head is not None:
        r = evaluate(head, model, ev, starts, max_depth=max(args.depth, 3))
        print(json.dumps({"kind": "trained head", "meta": meta, "acc": {m: round(v, 4) for m, v in r["acc"].items()},
                          "mean_accepted": round(r["mean_accepted"], 4)}), flush=True)


if __name__ == "__main__":
    main()
