"""Loading the models distillation reads: the target (teacher), the init source and the baselines.

A registered GGUF model is read through its cached bfloat16 conversion (the one `specfleet generate`
already made) and cast in memory, so asking for float32 never starts a second minute-long
conversion; the GGUF weights are 4-6 bit quantized, so bf16 holds them with room to spare.
Checkpoint folders (for example a distilled draft) load at the requested dtype.
"""
from __future__ import annotations

from pathlib import Path

import torch

from specfleet.core.model_ref import ModelRef
from specfleet.registry import resolve_model
from specfleet.runtime.loading.load import build_from_checkpoint
from specfleet.runtime.loading.checkpoint import Checkpoint, converted_folder, load_checkpoint
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.runtime.model.config import ModelConfig


def split_depth(name: str) -> tuple[str, int | None]:
    """'model@N' -> ('model', N): the first N layers only (the untrained truncated baseline)."""
    ref = ModelRef.parse(name)
    return ref.name, ref.num_layers


def load_source(name_or_path: str, dtype: torch.dtype = torch.float32) -> Checkpoint:
    path = resolve_model(name_or_path)
    is_folder = Path(path).is_dir()
    return load_checkpoint(path, dtype if is_folder else torch.bfloat16)


def load_config(name_or_path: str) -> tuple[ModelConfig, Path]:
    """(architecture, checkpoint folder with the tokenizer files) without reading the weights; a GGUF
    model's folder is its cached conversion."""
    path = Path(resolve_model(split_depth(name_or_path)[0]))
    folder = path if path.is_dir() else converted_folder(path, torch.bfloat16)
    return ModelConfig.from_json_file(folder / "config.json"), folder


def load_model(name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[DecoderLM, Checkpoint]:
    """A runtime model (inference only) for `name` or `name@N`, with its checkpoint's config and
    tokenizer folder; the checkpoint's weight dict is dropped."""
    base, depth = split_depth(name)
    ckpt = load_source(base, dtype)
    return build_from_checkpoint(ckpt, base, depth, dtype, torch.device(device)), ckpt


def load_tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
