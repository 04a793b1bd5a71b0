"""d for the draft head: one drafted token's cost in target decode steps, measured back to back.

    PYTHONPATH=. python benchmarks/drafts/head_cost.py --target qwen-1.5b --context 300 [--head FILE]

Alternates a plain target decode step (one token after `context` cached ones, native path, logits of
the full vocabulary) with one head draft step as HeadProposer runs it (embedding lookup, the head's
layer on its own cache of `context` entries, the reduced head, softmax), in one process, and reports
the median of each and their ratio: a ratio, so it holds on a shared machine better than either
timing. Without --head a head of the given shape is initialised from the target (the weights do not
change the cost).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen-1.5b")
    ap.add_argument("--head", default=None)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[16384])
    ap.add_argument("--intermediate", type=int, nargs="+", default=[2048])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specfleet.drafting.head import HeadCache, HeadDraftConfig, HeadProposer, init_from_target, load_head, target_embed
    from specfleet.runtime.kv.blocks import BlockManager
    from specfleet.runtime.kv.cache import KVCache
    from specfleet.runtime.loading.load import load_model
    from specfleet.runtime.step.runner import ForwardItem, ModelRunner

    model, _ = load_model(args.target, torch.float32, torch.device("cpu"), quantization="auto")
    n = args.context
    blocks = BlockManager(n // 16 + 4, 16)
    runner = ModelRunner(model, KVCache.allocate(model.config, n // 16 + 4, 16, torch.float32, "cpu"), torch.device("cpu"))
    blocks.reserve("r", n + 1)
    toks = torch.randint(100, 20000, (n + 1,)).tolist()
    runner.execute([ForwardItem("r", toks[:n], 0, [n - 1])], blocks)

    def target_step() -> float:
        t = time.perf_counter()
        runner.execute([ForwardItem("r", toks[n:], n, [0])], blocks)
        return time.perf_counter() - t

    shapes = [(v, i) for v in args.draft_vocab for i in args.intermediate] if args.head is None else [None]
    results = []
    for shape in shapes:
        if shape is None:
            head, _ = load_head(args.head)
        else:
            head = init_from_target(model, torch.arange(shape[0]), shape[1])
        prop = HeadProposer(head, model, HeadDraftConfig(quantize=True))
        h = prop.head
        cfg = h.config
        cache = HeadCache(cfg.num_kv_heads, cfg.head_dim, n + 8)
        cache.append(torch.randn(n, cfg.num_kv_heads, cfg.head_dim), torch.randn(n, cfg.num_kv_heads, cfg.head_dim))
        feat = torch.randn(1, cfg.hidden_size)

        @torch.inference_mode()
        def head_step() -> float:
            t = time.perf_counter()
            emb = target_embed(model, torch.tensor([toks[-1]]))
            f, logits = h.step(emb, feat, torch.tensor([n]), [cache], [1])
            p = torch.softmax(logits[0], -1)
            int(p.argmax())
            cache.truncate(n)
            return time.perf_counter() - t

        for _ in range(3):
            target_step(), head_step()
        ts, hs = [], []
        for r in range(args.rounds):
            if r % 2:
                hs.append(head_step()), ts.append(target_step())
            else:
                ts.append(target_step()), hs.append(head_step())
        t_med, h_med = statistics.median(ts), statistics.median(hs)
        rec = {"draft_vocab": cfg.draft_vocab, "intermediate": cfg.intermediate_size, "context": n,
               "target_step_ms": round(t_med * 1e3, 2), "head_step_ms": round(h_med * 1e3, 2),
               "d": round(h_med / t_med, 4), "threads": args.threads}
        results.append(rec)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
