"""Writing the distilled draft as an ordinary checkpoint folder that `load_checkpoint`, `LLM(...,
draft=DIR)` and transformers load like any other model: config.json, model.safetensors (Hugging Face
tensor names, full vocabulary, untied head) and the target's tokenizer files.

Two extra files ride along and are ignored by loaders: draft_vocab.json (the K token ids the head was
trained on; a runtime that supports a reduced head could skip the zero rows) and distill.json (how
the draft was made).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from specfleet.distill.student import Student

# every file a tokenizer folder may hold; whichever exist are copied
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def save_draft(out_dir: Path, student: Student, tokenizer_dir: Path, dtype: torch.dtype, meta: dict) -> Path:
    """Write the draft into `out_dir`; the weights file is replaced atomically."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = student.spec.model_config()
    weights = student.export_weights(dtype)
    tmp = out_dir / ".model.safetensors.tmp"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / "model.safetensors")
    hf = cfg.to_hf_dict() | {"dtype": str(dtype).removeprefix("torch.")}
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    copied = 0
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file() and src.resolve() != (out_dir / name).resolve():
            shutil.copyfile(src, out_dir / name)
            copied += 1
    ids = student.vocab_ids.tolist()
    (out_dir / "draft_vocab.json").write_text(json.dumps(
        {"num_tokens": len(ids), "vocab_size": cfg.vocab_size, "token_ids": ids,
         "note": "lm_head rows of all other token ids are zero (logit 0)"}))
    (out_dir / "distill.json").write_text(json.dumps(meta, indent=2, default=str))
    return out_dir
