"""The per-run report: the distilled draft beside its untrained start and the baselines, written with
bench.report.write_results (JSON + Markdown under benchmarks/results/)."""
from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import torch

from specfleet.bench.report import md_table, write_results
from specfleet.distill.data import Example, Sequence
from specfleet.distill.evaluate import compare_drafts
from specfleet.distill.sources import load_model

logger = logging.getLogger(__name__)


def default_baselines(init_from: str, target: str, num_layers: int) -> list[str]:
    """The init source cut to the draft's depth (untrained), and the init source whole."""
    if init_from == "none":
        return []
    cut = f"{init_from}@{num_layers}"
    return [cut] if init_from == target else [cut, init_from]


def evaluate_and_report(args, out: Path, meta: dict, train_ex: list[Example], held_ex: list[Example],
                        held_seqs: list[Sequence], dtype: torch.dtype, device: torch.device) -> dict:
    spec = meta["spec"]
    compare = args.compare
    if compare is None:
        compare = default_baselines(spec["init_from"], meta["target"], spec["config"]["num_layers"])
    compare = [c for c in compare if c.lower() != "none"]
    loaders = {"distilled": lambda: load_model(str(out), dtype, device)[0]}
    loaders |= {name: (lambda name=name: load_model(name, dtype, device)[0]) for name in compare}
    target, _ = load_model(args.target, dtype, device)
    # the shortest held-out prompts: prefill on a CPU costs as much as many decode steps
    prompts = sorted((ex.prompt_ids for ex in held_ex), key=len)[:args.eval_prompts]
    # continuations from another teacher: agreement is measured against the target's own argmax
    figures = compare_drafts(target, loaders, held_seqs, prompts, args.eval_max_tokens, args.spec_len,
                             args.batch_tokens, target_labels=meta["teacher"] != meta["target"])
    del target
    gc.collect()
    first, last = meta["history"][0], meta["history"][-1]
    if meta["teacher"] == meta["target"]:  # the training history measured agreement with the teacher's tokens
        figures["drafts"].insert(1, {"draft": "distilled, before training",
                                     "heldout_agreement": first.get("heldout_agreement")})
    vocab = set(json.loads((out / "draft_vocab.json").read_text())["token_ids"])
    held_tokens = [t for ex in held_ex for t in ex.continuation_ids]
    payload = {
        "target": meta["target"], "teacher": meta["teacher"], "draft_dir": str(out), "spec": spec,
        "data": {"train_examples": len(train_ex), "heldout_examples": len(held_ex),
                 "train_continuation_tokens": sum(len(ex.continuation_ids) for ex in train_ex),
                 "heldout_vocab_coverage": sum(t in vocab for t in held_tokens) / max(1, len(held_tokens)),
                 "max_new_tokens": args.max_new_tokens},
        "training": {"seconds": meta["training_s"], "steps": meta["steps"], "epochs": meta["epochs"],
                     "heldout_loss": [first.get("heldout_loss"), last.get("heldout_loss")],
                     "heldout_agreement": [first.get("heldout_agreement"), last.get("heldout_agreement")],
                     "history": meta["history"], "config": meta["train_config"]},
        "timings_s": meta["timings"], "comparison": figures,
    }
    path = write_results("distill", payload, _markdown(payload), device=str(device), dtype=args.eval_dtype)
    logger.info("report written to %s", path)
    print(_markdown_rows(figures))
    return payload


def _markdown_rows(figures: dict) -> str:
    cols = ["draft", "params", "layers", "heldout_agreement", "mean_accepted_length", "acceptance_rate",
            "decode_tok_s", "speedup", "cost_per_token", "same_output_as_plain"]
    rows = [{**r, "params": f"{r['params'] / 1e6:.1f}M" if r.get("params") else ""} for r in figures["drafts"]]
    t = figures["target"]
    target = f"\ntarget: {t['params'] / 1e6:.1f}M parameters, {t['layers']} layers"
    if "decode_tok_s" in t:
        target += f", plain decode {t['decode_tok_s']:.2f} tok/s ({t['s_per_token']:.3f} s/token)"
    return md_table(rows, cols) + target


def _markdown(p: dict) -> str:
    d, tr, cfg = p["data"], p["training"], p["spec"]["config"]
    c = p["comparison"]
    lines = [
        f"Draft `{p['draft_dir']}` for `{p['target']}`, trained on `{p['teacher']}`'s greedy outputs: "
        f"{cfg['num_layers']} layers, width "
        f"{cfg['hidden_size']}, MLP {cfg['intermediate_size']}, initialised from `{p['spec']['init_from']}` "
        f"(layers {list(p['spec']['layer_ids'])}), head over {p['spec']['vocab_size']} tokens "
        f"(held-out coverage {d['heldout_vocab_coverage']:.3f}), embeddings "
        f"{'frozen' if p['spec']['freeze_embeddings'] else 'trained'}.",
        "",
        f"Data: {d['train_examples']} training continuations ({d['train_continuation_tokens']} tokens, up to "
        f"{d['max_new_tokens']} each), {d['heldout_examples']} held out. Generation "
        f"{p['timings_s'].get('generation_s', 0):.0f} s this run; teacher top-k "
        f"{p['timings_s'].get('teacher_topk_s', 0):.0f} s.",
        "",
        f"Training: {tr['seconds']:.0f} s, {tr['steps']} steps, {tr['epochs']} full epochs; held-out loss "
        f"{_f(tr['heldout_loss'][0])} -> {_f(tr['heldout_loss'][1])}, held-out greedy agreement with the "
        f"teacher's tokens {_f(tr['heldout_agreement'][0])} -> {_f(tr['heldout_agreement'][1])}. In the table, "
        "heldout_agreement is against the target's argmax.",
        "",
        f"Comparison on the held-out set ({c['num_prompts']} prompts x {c['max_tokens']} tokens for the "
        f"speculative runs, spec length {c['spec_len']}, one prompt at a time; cost_per_token = the draft's "
        "plain decode time per token over the target's):",
        "",
        _markdown_rows(c),
    ]
    return "\n".join(lines)


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"
