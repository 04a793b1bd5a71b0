"""Each layer's compute route, fixed once: the one place that decides which backend a model computes on.

The model's modules (runtime/model/) import no backend. A `Linear` calls its `route`, an `RMSNorm` its
`route` when it has one, `DecoderLM.compute_logits` the model's `head_route`, and `DecoderLM.forward` the
model's `fused_layers` (every decoder layer in one native call) when it has one. `bind` sets them from the
model's device and RuntimeConfig:

- CUDA with the batch-invariant kernels (`RuntimeConfig.cuda_kernels` and Triton importable): their linear
  and RMSNorm (a row summed as its decode step sums it, whatever the other rows; runtime/backends/cuda/);
- CPU: the CPU linear routes of runtime/backends/cpu.py with the config's row thresholds, and for a GGUF
  model whose layers are all in block formats, the native layers (runtime/backends/native/forward.py);
- anything else: torch's `F.linear` and the norm's torch body.

It runs when a model is built (runtime/loading/build.py), when a runner takes it (the KV cache and device
are then fixed; runtime/step/runner.py) and again whenever `DecoderLM.set_runtime` replaces the config, so
no product re-decides its backend per call. Block-format layers (runtime/formats/qlinear.py) take the
native library when they are made.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from specfleet.runtime.backends.cpu import cpu_linear
from specfleet.runtime.backends.cuda import kernels as cuda_kernels
from specfleet.runtime.backends.native.forward import fused_layers_route
from specfleet.runtime.config import RuntimeConfig
from specfleet.runtime.model.decoder import DecoderLM, Linear, RMSNorm


def linear_route(device: torch.device, rt: RuntimeConfig) -> Callable:
    """(x, weight, bias) -> y for dense weights on `device` under `rt`."""
    if rt.cuda_kernels and cuda_kernels.available(device):
        return cuda_kernels.linear
    if device.type == "cpu":
        upcast, left, native = rt.upcast_rows, rt.weight_left, rt.native_rows

        def cpu_route(x, weight, bias):
            return cpu_linear(x, weight, bias, upcast, left, native)

        return cpu_route
    return F.linear


def norm_route(device: torch.device, rt: RuntimeConfig) -> Callable | None:
    """(x, weight, eps, unit_offset) -> y, or None for the norm's own torch body."""
    return cuda_kernels.rms_norm if rt.cuda_kernels and cuda_kernels.available(device) else None


def bind_linear(module: Linear, device: torch.device, rt: RuntimeConfig) -> Linear:
    module.route = linear_route(device, rt)
    return module


def bind(model: DecoderLM, device: torch.device | str | None = None) -> DecoderLM:
    """Fix every route of `model` for `device` (default: where its rotary tables are) and its RuntimeConfig."""
    device = torch.device(device) if device is not None else model.rotary.cos.device
    rt = model.runtime
    dense, norm = linear_route(device, rt), norm_route(device, rt)
    for m in model.modules():
        if isinstance(m, Linear):
            m.route = dense
        elif isinstance(m, RMSNorm):
            m.route = norm
    model.head_route = dense
    model.fused_layers = fused_layers_route(model) if rt.fused_native and device.type == "cpu" else None
    model.binder = _rebind
    model.bound_device = device
    return model


def _rebind(model: DecoderLM) -> None:
    bind(model, model.bound_device)
