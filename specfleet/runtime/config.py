"""How the runtime computes a model's forward (never what): the routes of its linear layers, whether a
native GGUF model runs its layers in one C call, whether CUDA takes the batch-invariant kernels.

One `RuntimeConfig` belongs to a model (`DecoderLM.runtime`, replaced with `DecoderLM.set_runtime`, which
hands it to every module that reads it) and is passed in by whoever builds the model (`LLM(...,
runtime=...)`), instead of module-level switches that tests and benchmarks patch. Each field defaults to its
environment variable where it has one, else to the value measured best on this machine, so `RuntimeConfig()`
is what a process gets without asking. Every setting keeps the contract that makes speculation lossless: a
row's result does not depend on the other rows of its call (except `cuda_kernels=False`, which is there to
measure what that contract costs on a GPU).

The kernels' ISA path is a property of the process, not of a model (one library per process): see
runtime/backends/native/kernels.py and `SPECFLEET_ISA`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


def _native_bf16() -> bool:
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def default_upcast_rows() -> int:
    """Rows from which a bf16 CPU linear computes in fp32 (0 = never): 0 where the CPU has native bf16
    matmuls, else 4. Measured on the 1.5B's layer shapes (2-core AVX2 EPYC), cost against one bf16 row,
    torch bf16 -> sliced fp32: 2 rows 1.7 -> 2.6 (so not there), 4 rows 3.4 -> 2.2, 5 rows 4.1 -> 2.9,
    8 rows 7.0 -> 3.8, 16 rows 13.9 -> 3.5, 64 rows 53 -> 8.7.
    `SPECFLEET_CPU_UPCAST_ROWS` overrides it."""
    env = os.environ.get("SPECFLEET_CPU_UPCAST_ROWS")
    if env is not None:
        return max(0, int(env))
    return 0 if _native_bf16() else 4


def default_native_rows() -> int:
    """Rows up to which a bf16 CPU linear uses the native kernel (0 = never): 0 where the CPU has native
    bf16 matmuls (oneDNN's kernels serve it), else 32 (from 32 rows on, prefill-sized products, BLAS on
    sliced fp32 weights is as fast). `SPECFLEET_CPU_NATIVE_ROWS` overrides it; `SPECFLEET_NATIVE=0`
    turns the kernel off altogether."""
    env = os.environ.get("SPECFLEET_CPU_NATIVE_ROWS")
    if env is not None:
        return max(0, int(env))
    return 0 if _native_bf16() else 32


def default_weight_left() -> bool:
    """Whether fp32 CPU products of 2+ rows use W @ x^T. `SPECFLEET_CPU_WEIGHT_LEFT=0` turns it off."""
    return os.environ.get("SPECFLEET_CPU_WEIGHT_LEFT", "1") not in ("0", "false", "no", "off")


def _cuda_kernels_default() -> bool:
    return os.environ.get("SPECFLEET_CUDA_KERNELS", "1") != "0"


@dataclass(frozen=True)
class RuntimeConfig:
    # bf16 CPU linear layers (runtime/backends/cpu.py): rows from which they compute in fp32 (0 = never),
    # SPECFLEET_CPU_UPCAST_ROWS; whether fp32 products of 2+ rows run as W @ x^T, SPECFLEET_CPU_WEIGHT_LEFT;
    # rows up to which the native bf16 kernel serves them (0 = never), SPECFLEET_CPU_NATIVE_ROWS
    upcast_rows: int = field(default_factory=default_upcast_rows)
    weight_left: bool = field(default_factory=default_weight_left)
    native_rows: int = field(default_factory=default_native_rows)
    # native GGUF models (every linear a block-format QLinear, fp32, CPU) run each step's decoder layers in
    # one call into csrc/q_fused.c (runtime/backends/native/forward.py); False: the module-by-module forward
    fused_native: bool = True
    # CUDA: the batch-invariant Triton kernels (runtime/backends/cuda/kernels.py); False (SPECFLEET_CUDA_KERNELS=0):
    # cuBLAS and SDPA, which are not row-invariant (for comparisons only)
    cuda_kernels: bool = field(default_factory=_cuda_kernels_default)
    # CUDA, with the kernels: replay captured graphs of the step shapes that repeat (decode, chain drafting, chain
    # and tree verification, requests of different lengths padded to the longest; runtime/backends/cuda/graphs.py);
    # SPECFLEET_CUDA_GRAPHS=0 launches every step eagerly
    cuda_graphs: bool = field(default_factory=lambda: os.environ.get("SPECFLEET_CUDA_GRAPHS", "1") != "0")
    # the memory the captured graphs of one model keep for their outputs (each shape's logits and hidden
    # states stay allocated between replays); a shape that would pass it runs eagerly (runtime/backends/cuda/graphs.py)
    cuda_graph_bytes: int = 512 << 20

    def __post_init__(self):
        if self.upcast_rows < 0 or self.native_rows < 0:
            raise ValueError(f"upcast_rows and native_rows must be >= 0, got {self.upcast_rows}, {self.native_rows}")
        if self.cuda_graph_bytes < 0:
            raise ValueError(f"cuda_graph_bytes must be >= 0, got {self.cuda_graph_bytes}")
