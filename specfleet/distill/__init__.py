"""Draft distillation: train small drafts that agree with the target (`specfleet distill`).

data.py      target continuations as JSONL (generated once, resumable), held-out split, batches
init.py      the student's shape and starting weights (copied layers, projected embeddings)
student.py   the student: DecoderLM body + reduced-vocabulary head, differentiable forward, export
teacher.py   the target's top-k distribution for the KL term (cached or online)
losses.py    cross-entropy + KL, both on the exported draft's full-vocabulary distribution
train.py     AdamW under a time budget with checkpoints and resumption
export.py    the draft as an ordinary checkpoint folder
evaluate.py  held-out agreement, speculative runs, cost per token
report.py    the per-run report beside the baselines
pipeline.py  one run, start to finish;  cli.py  the command line
"""
