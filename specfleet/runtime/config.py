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

from specfleet.runtime.backends.cpu import default_native_rows, default_upcast_rows, default_weight_left


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
    # CUDA, with the kernels: replay captured graphs of the step shapes that repeat (decode, chain drafting and
    # chain verification; runtime/backends/cuda/graphs.py); SPECFLEET_CUDA_GRAPHS=0 launches every step eagerly
    cuda_graphs: bool = field(default_factory=lambda: os.environ.get("SPECFLEET_CUDA_GRAPHS", "1") != "0")
    # the memory the captured graphs of one model keep for their outputs (each shape's logits and hidden
    # states stay allocated between replays); a shape that would pass it runs eagerly (cuda_graphs.py)
    cuda_graph_bytes: int = 512 << 20

    def __post_init__(self):
        if self.upcast_rows < 0 or self.native_rows < 0:
            raise ValueError(f"upcast_rows and native_rows must be >= 0, got {self.upcast_rows}, {self.native_rows}")
        if self.cuda_graph_bytes < 0:
            raise ValueError(f"cuda_graph_bytes must be >= 0, got {self.cuda_graph_bytes}")
