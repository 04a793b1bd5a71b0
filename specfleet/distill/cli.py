"""`specfleet distill`: train a small draft on the target's own greedy outputs.

    specfleet distill --target qwen2.5-coder-1.5b-instruct --out drafts/qwen-d2 \\
        --dataset humaneval --dataset chitchat --num-prompts 64 --init-from qwen-0.5b --layers 2 \\
        --vocab-top 16384 --time-budget-min 60

Steps: target continuations (saved to OUT/continuations.jsonl, reused and completed on rerun) ->
a student initialised from a trained model of the same tokenizer -> training under a time budget
(OUT/train_state.pt every few minutes; --resume continues) -> OUT is a checkpoint folder usable as
`--draft OUT` -> a report under benchmarks/results/ comparing it with the baselines.
"""
from __future__ import annotations

import argparse

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_INIT = "qwen2.5-coder-0.5b-instruct"


def add_distill_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("distill", help="distill a small draft model from a target's outputs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="registered model name, HF folder or .gguf file")
    p.add_argument("--out", required=True, help="output folder: the draft checkpoint, its data and training state")
    p.add_argument("--teacher", default=None,
                   help="model whose greedy outputs (and KL) train the draft (default: the target); a cheaper model "
                        "of the same tokenizer buys more data per CPU hour, and the evaluation still uses --target")
    p.add_argument("--teacher-quantization", default="none", choices=["none", "int8"],
                   help="int8: the teacher runs with weight-only int8 linear layers (runtime/formats/quant.py), several "
                        "times faster for batched generation on CPUs without bf16 units; its greedy outputs are "
                        "then the quantized model's, nearly always the target's")
    p.add_argument("--resume", action="store_true", help="continue the training checkpoint in --out")
    p.add_argument("--dtype", default="float32",
                   help="dtype of the teacher (generation, KL); float32 runs batched matmuls faster than bfloat16 "
                        "on CPUs without bf16 units")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--seed", type=int, default=0)

    d = p.add_argument_group("data")
    d.add_argument("--dataset", action="append", default=[],
                   help="prompt set (repeatable): humaneval, chitchat, sharegpt or file:PATH "
                        "(default: humaneval and chitchat)")
    d.add_argument("--prompts", action="append", default=[], metavar="FILE",
                   help="a text file with one chat prompt per line (repeatable; same as --dataset file:FILE)")
    d.add_argument("--num-prompts", type=int, default=64, help="prompts taken from each dataset")
    d.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts")
    d.add_argument("--max-new-tokens", type=int, default=64, help="length of each target continuation")
    d.add_argument("--gen-batch", type=int, default=16, help="prompts the target continues at once")
    d.add_argument("--continuations", help="JSONL of continuations to read and extend (default "
                                           "OUT/continuations.jsonl, or OUT/continuations-TEACHER.jsonl); "
                                           "without any --dataset/--prompts only its records are used")
    d.add_argument("--num-heldout", type=int, default=8, help="examples kept out of training for evaluation")
    d.add_argument("--label-prompts", action=argparse.BooleanOptionalAction, default=False,
                   help="also train on the prompt positions, labelled by the teacher's argmax (one teacher forward "
                        "per example, cached): on a CPU a full-sequence forward labels tokens several times "
                        "faster than generating them")
    d.add_argument("--num-text-prompts", type=int, default=0,
                   help="further prompts per dataset used as teacher-labelled text only, without generating a "
                        "continuation (needs --label-prompts)")

    m = p.add_argument_group("student")
    m.add_argument("--init-from", default=DEFAULT_INIT,
                   help="'target', 'none' (random) or a model (name or path) sharing the target's tokenizer, "
                        "e.g. qwen-0.5b; embeddings, head and layers are copied from it")
    m.add_argument("--layers", type=int, default=2, help="transformer layers of the draft")
    m.add_argument("--init-layers", default="spread", help="source layers to copy: spread | first | i,j,...")
    m.add_argument("--hidden", type=int, default=None,
                   help="width (default: the init source's); a narrower width projects embeddings and head")
    m.add_argument("--intermediate", type=int, default=None,
                   help="MLP width (copied layers keep their strongest neurons)")
    m.add_argument("--heads", type=int, default=None, help="attention heads (only for a width unlike the source's)")
    m.add_argument("--kv-heads", type=int, default=None, help="key/value heads (likewise)")
    m.add_argument("--freeze-embeddings", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the input embedding table fixed (default on: it is most of the parameters)")
    m.add_argument("--freeze-head", action=argparse.BooleanOptionalAction, default=False,
                   help="keep the output head fixed")
    m.add_argument("--vocab-top", type=int, default=16384,
                   help="the head predicts only the K most frequent tokens of the continuations; 0 = full vocabulary")

    t = p.add_argument_group("training")
    t.add_argument("--time-budget-min", type=float, default=60.0,
                   help="training wall-clock budget (all resumes together)")
    t.add_argument("--max-steps", type=int, default=None)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per optimizer step")
    t.add_argument("--max-seq-len", type=int, default=512, help="prompts are cut from the left to fit")
    t.add_argument("--checkpoint-every-min", type=float, default=5.0)
    t.add_argument("--kl-weight", type=float, default=0.0, help="weight of KL(target || draft) beside the token loss")
    t.add_argument("--kl-source", choices=("cache", "online"), default="cache",
                   help="target top-k computed once per example and cached, or on the fly every step")
    t.add_argument("--kl-top-k", type=int, default=32)
    t.add_argument("--save-dtype", default="bfloat16", help="dtype of the saved draft weights")

    e = p.add_argument_group("evaluation")
    e.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True, help="evaluate and write a report")
    e.add_argument("--eval-dtype", default="bfloat16",
                   help="dtype of target and drafts in the evaluation (float32 makes speculative output equal plain "
                        "output exactly)")
    e.add_argument("--eval-prompts", type=int, default=4,
                   help="the shortest held-out prompts used for the speculative runs (0 = agreement only)")
    e.add_argument("--eval-max-tokens", type=int, default=64)
    e.add_argument("--num-speculative-tokens", "--spec-len", dest="spec_len", type=int, default=4,
                   help="draft tokens per verification step")
    e.add_argument("--compare", action="append", default=None,
                   help="baseline draft (repeatable; NAME@N = first N layers); default: the init source cut to "
                        "--layers layers, and the init source whole")
    p.set_defaults(func=run_distill)
    return p


def run_distill(args) -> int:
    from specfleet.distill.pipeline import Distillation

    Distillation(args).run()
    return 0
