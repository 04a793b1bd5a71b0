"""Tiny models whose matrices are kept in GGUF block formats (runtime/formats/qtensor.py), shared by the tests:
built in memory from a random transformers model, or written to a small GGUF file the way llama.cpp
writes one (q/k rows permuted for the `llama` arch), with mixed formats so that fused projections
split into several products (q, k in one format, v in another)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from specfleet.runtime.loading.build import build_model
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.runtime.model.config import ModelConfig
from specfleet.runtime.formats.qtensor import quantize
from tests.runtime.loading.test_checkpoint import gguf_name, llamacpp_permute, write_tiny_header

Q = gguf.GGMLQuantizationType
# v_proj and down_proj take another format than the rest, as in llama.cpp's *_K_M mixes
FORMATS = {"v_proj": Q.Q4_0, "down_proj": Q.Q4_0}
DEFAULT_FORMAT = Q.Q8_0


def format_of(name: str, default=DEFAULT_FORMAT):
    return next((f for key, f in FORMATS.items() if f".{key}." in name), default)


def quantized_weights(model, default=DEFAULT_FORMAT) -> dict:
    """HF-named weights of a transformers model with every matrix (embedding and head too) a QTensor."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        out[name] = quantize(t.float(), format_of(name, default)) if t.ndim == 2 else t.float()
    return out


def quantized_model(model, default=DEFAULT_FORMAT) -> DecoderLM:
    """Our DecoderLM over `model`'s weights quantized with `quantized_weights` (fp32 activations)."""
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    m = build_model(cfg, quantized_weights(model, default), torch.float32, torch.device("cpu"))
    m.quantization = "gguf"
    return m


def write_quantized_gguf(path: Path, model, arch: str, overrides: dict | None = None) -> None:
    """Write `model` as a GGUF file with its matrices in block formats (`overrides`: GGUF tensor name ->
    a GGMLQuantizationType written as raw bytes of that type, for formats gguf-py cannot quantize)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    write_tiny_header(w, cfg, arch)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            x = llamacpp_permute(x, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            x = llamacpp_permute(x, cfg.num_key_value_heads)
        target = gguf_name(name)
        if overrides and target in overrides:
            kind = overrides[target]
            block, size = gguf.GGML_QUANT_SIZES[kind]
            raw = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(target, raw, raw_dtype=kind)
        elif x.ndim == 2:
            kind = format_of(name)
            w.add_tensor(target, gguf.quants.quantize(np.ascontiguousarray(x), kind), raw_dtype=kind)
        else:
            w.add_tensor(target, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

