"""Acceptance of the draft head in the engine (not a timing: it holds on a shared machine).

    PYTHONPATH=. python benchmarks/drafts/head_accept.py --target qwen-1.5b --prompts 10 --max-tokens 64 \\
        --draft 'head' --draft 'fleet(head,suffix,prompt-lookup)'

Runs the first HumanEval prompts (raw, as the fleet preset does) greedily with plain decoding and with
each draft, and reports per draft: whether every output equals plain decoding, acceptance by position
(fraction of steps whose accepted path reached depth k), mean accepted tokens per step, drafted and
accepted tokens, and tokens per target step.
"""
from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen-1.5b")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft", action="append", default=[])
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specfleet.bench.datasets import iter_prompts, select
    from specfleet.llm import LLM
    from specfleet.runtime.loading.load import load_model
    from specfleet.sampling_params import SamplingParams

    model, tok = load_model(args.target, torch.float32, torch.device("cpu"), quantization="auto")
    source, is_chat = iter_prompts(args.dataset)
    prompts = select(source, args.prompts, shuffle_seed=0 if args.dataset == "sharegpt" else None)
    if is_chat:
        ids = [tok.apply_chat_template(p.as_messages(), tokenize=True, add_generation_prompt=True) for p in prompts]
    else:
        ids = [tok.encode(p.text, add_special_tokens=True) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = [o.token_ids for o in LLM.from_model(model, tok, draft=None).generate(ids, params)]
    for spec in args.draft:
        llm = LLM.from_model(model, tok, draft=spec, max_num_seqs=1)
        outs = []
        for p in ids:  # batch 1, as the fleet preset measures
            outs += llm.generate([p], params)
        st = llm.engine.stats
        rec = {"draft": spec, "dataset": args.dataset, "prompts": len(ids), "max_tokens": args.max_tokens,
               "equal_to_plain": [o.token_ids for o in outs] == plain, **st.as_dict()}
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
