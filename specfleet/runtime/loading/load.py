"""Loading a model by name: resolve it in the registry, read the checkpoint (GGUF natively or
dequantized), build the runtime model and optionally its tokenizer."""
from __future__ import annotations

from dataclasses import replace

import torch

from specfleet.core.model_ref import ModelRef
from specfleet.errors import InvalidRequestError, ModelLoadError
from specfleet.registry import resolve_model
from specfleet.runtime.loading.build import build_model
from specfleet.runtime.loading.checkpoint import is_gguf_file, load_checkpoint
from specfleet.runtime.formats.quant import BLOCK_FORMATS, parse_quantization, quantize_model, resolve_quantization


def load_model(name_or_path: str | ModelRef, dtype: torch.dtype, device: torch.device, with_tokenizer: bool = True,
               quantization: str | None = None):
    """Resolve a registered name or path, load (and cache) the checkpoint, build our model on `device`.

    `quantization` (runtime/formats/quant.py): None/"none" dense weights in `dtype`; "auto" keeps a GGUF file's
    block formats on the CPU ("gguf": fp32 activations, `dtype` unused) and is dense elsewhere; "int8"
    weight-only int8; "q4_0"/"q8_0"/"q4_k" requantize every matrix at load.

    `NAME@N` keeps only the first N transformer layers (a cheap derived draft; the final norm and
    head are kept, so it still speaks the target's vocabulary).
    """
    ref = ModelRef.parse(name_or_path)
    name_or_path, num_layers = ref.name, ref.num_layers
    path = resolve_model(name_or_path)
    mode = resolve_quantization(parse_quantization(quantization), is_gguf_file(path), device)
    if mode in BLOCK_FORMATS:
        ckpt = load_checkpoint(path, quantization=mode)
        dtype = torch.float32  # activations of the block-format kernels
    else:
        ckpt = load_checkpoint(path, dtype)
    model = build_from_checkpoint(ckpt, name_or_path, num_layers, dtype, device)
    if mode in BLOCK_FORMATS:
        model.quantization = mode
    quantize_model(model, mode)
    model.source_path = str(path)  # the file it came from (a draft head is found and hash-checked by it)
    tokenizer = None
    if with_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(ckpt.tokenizer_dir), local_files_only=True)
        check_tokenizer_fits(tokenizer, model.config.vocab_size, path)
    return model, tokenizer


def check_tokenizer_fits(tokenizer, vocab_size: int, source) -> None:
    """A tokenizer with more tokens than the embedding has rows would hand the model ids past its last
    row (an index error mid-request, or garbage): refused at load, naming both sizes."""
    n = len(tokenizer)
    if n > vocab_size:
        raise ModelLoadError(f"{source}: the tokenizer has {n:,} tokens but the model's embedding has only "
                             f"{vocab_size:,} rows (vocab_size); the tokenizer does not belong to these weights")


def build_from_checkpoint(ckpt, name: str, num_layers: int | None, dtype: torch.dtype,
                          device: torch.device) -> "torch.nn.Module":
    """The runtime model of a loaded checkpoint, cut to its first `num_layers` layers if given; the
    checkpoint's weight dict is emptied (the model holds the tensors now)."""
    cfg = ckpt.config
    if num_layers is not None:
        if num_layers > cfg.num_layers:
            raise InvalidRequestError(f"{name} has {cfg.num_layers} layers; cannot keep {num_layers}")
        cfg = replace(cfg, num_layers=num_layers)
    model = build_model(cfg, ckpt.weights, dtype, device)
    ckpt.weights = {}
    return model
