"""Turning a loaded checkpoint into a ready model on a device, without a throwaway random init."""
from __future__ import annotations

import torch

from specfleet.errors import InvalidRequestError
from specfleet.runtime.backends.bind import bind
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.runtime.model.config import ModelConfig
from specfleet.runtime.loading.weights import install_quantized, load_weights

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise InvalidRequestError(f"unknown device {device!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {device!r} requested but no CUDA GPU is available")
    return dev


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> DecoderLM:
    with torch.device("meta"):
        model = DecoderLM(cfg)
    install_quantized(model, weights)  # GGUF-format weights replace their layers before anything is allocated
    model = model.to_empty(device=device).to(dtype)
    load_weights(model, weights)
    model.init_rotary(device)
    return bind(model.eval().requires_grad_(False), device)
