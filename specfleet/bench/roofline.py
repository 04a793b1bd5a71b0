"""The memory-bandwidth bound on decoding speed: measured copy bandwidth / bytes read per step.

A decode step of a memory-bound model reads every weight once, whatever the batch; the KV cache and
activations are small next to a 1.5B model's weights for short contexts, so they are left out
(the bound is optimistic, as a roofline should be).
"""
from __future__ import annotations

import time

import torch
from torch import nn


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of parameters one decode step reads. An untied input embedding is a row lookup, not a
    full read, so it is left out; a tied one is read in full by the output head and stays in."""
    params = {id(p): p for p in model.parameters()}  # tied weights appear once
    total = sum(p.numel() * p.element_size() for p in params.values())
    heads = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    # our DecoderLM reuses embed_tokens.weight as its head, unless quantization gave it an int8 head_q
    is_tied_by_hand = getattr(model, "lm_head", True) is None and getattr(model, "head_q", None) is None
    for m in model.modules():
        if isinstance(m, nn.Embedding) and id(m.weight) not in heads and not is_tied_by_hand:
            total -= m.weight.numel() * m.weight.element_size()
    # weights kept in GGUF block formats (runtime/formats/qlinear.py) are no parameters; the embedding is a lookup
    total += sum(m.weight_nbytes for m in model.modules() if hasattr(m, "weight_nbytes") and
                 not hasattr(m, "weight_q"))
    return total


def measure_bandwidth(device: torch.device | str, num_bytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second of a large device-to-device tensor copy (each copy reads and writes
    `num_bytes`, so it moves 2 x num_bytes); the best of `repeats` timings."""
    device = torch.device(device)
    if num_bytes is None:
        num_bytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    n = num_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up: page in both buffers
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
