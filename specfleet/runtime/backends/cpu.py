"""Linear layers on the CPU for the few-row batches of speculative verification and the big ones of prefill.

Decoding one token reads every weight once and is bound by memory bandwidth; verifying k drafted tokens
multiplies the same weights by k+1 rows, which on a GPU costs about what one row does. On a CPU the
answer depends on the kernel torch picks, and on an AVX2 CPU (no native bf16 or AMX units) the default
choices are poor for the shapes speculation produces (benchmarks/results/kernels-cpu-*.md):

- bf16 weights, `F.linear`: the matmul is emulated and compute-bound from two rows on, so 16 rows cost
  about 13x one row;
- fp32 weights, `F.linear(x, W)` = x @ W^T: the BLAS call with the activations as the left operand
  runs a 4-row product at about 3x the cost of one row;
- the same product written as (W @ x^T)^T, the weight on the left, reaches the BLAS kernels built for a
  tall left matrix and a thin right one: 2-4 rows cost about what one row does, 16 rows about twice.

So on CPUs without native bf16 this module computes
- bf16 weights with up to `native_rows` rows (32 by default): specfleet's own AVX2 kernel
  (csrc/arch/x86/bf16_linear.c via runtime/backends/native/kernels.py), which reads each weight once, widens it in registers and
  multiplies it by every row, so 5 rows cost about what one row of torch's kernel does and one row
  costs less (benchmarks/RESULTS.md, the CPU kernels: one decoder layer of the 1.5B, 1/2/5/8/16/32
  rows cost 0.66/0.71/1.09/1.60/2.66/5.46x torch's one row, against torch's 1.96x at 2 rows,
  4.75/7.57/14.8/29.4x at 5/8/16/32 and the sliced route's 3.05/3.78/3.70/5.51x);
  where it cannot be built (see runtime/backends/native/kernels.py) the two routes below take over;
- fp32 weights with 2 <= rows: W @ x^T (then transposed back), the same arithmetic;
- bf16 weights with >= `upcast_rows` rows (4 by default) not taken by the native kernel, and int8 weights with >= `INT8_SLICED_ROWS`
  (runtime/formats/quant.py; below that the packed int8 kernel is faster): in fp32, converting the weight in slices of about
  `SLICE_BYTES` (so each slice is still in cache when the product reads it) and multiplying each slice
  by x^T as above. Converting the whole weight first (the earlier scheme) costs two more passes over
  memory than the product itself, which made 16 rows slower than bf16.

Results are the fp32 products of the same numbers, so they differ from `F.linear` only in summation order
(rounding), the same freedom any BLAS has between batch sizes. Everything else, and anything recording
gradients, goes to `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specfleet.runtime.backends.native import kernels as native_backend

SLICE_BYTES = 4 << 20  # fp32 bytes of weight converted per slice (measured best of 0.5-8 MiB on a 2-core EPYC)


def weight_left_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] @ weight[N, K]^T (+ bias) as (weight @ x2^T)^T; fp32 in, contiguous fp32 [M, N] out."""
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x2.dtype)
    out.copy_(torch.mm(weight, x2.t()).t())
    if bias is not None:
        out += bias
    return out


def sliced_upcast_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         slice_bytes: int = SLICE_BYTES) -> torch.Tensor:
    """x2 [M, K] (any float dtype) @ weight [N, K]^T in fp32, converting `weight` a slice of rows at a
    time; returns fp32 [M, N]."""
    n, k = weight.shape
    rows = max(16, slice_bytes // (4 * k))
    xt = x2.float().t()
    out_t = torch.empty((n, x2.shape[0]), dtype=torch.float32)
    buf = torch.empty((min(rows, n), k), dtype=torch.float32)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        part = buf[: stop - start]
        part.copy_(weight[start:stop])
        torch.mm(part, xt, out=out_t[start:stop])
    out = torch.empty((x2.shape[0], n), dtype=torch.float32)
    out.copy_(out_t.t())
    if bias is not None:
        out += bias.float()
    return out


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, upcast_rows: int,
               weight_left: bool, native_rows: int = 0) -> torch.Tensor:
    """F.linear for CPU tensors, routed as the module docstring says (inference only: anything that
    records gradients, such as training a draft, takes F.linear)."""
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (0 < rows <= native_rows and weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16
            and weight.is_contiguous()):
        lib = native_backend.library()
        if lib is not None:
            out = native_backend.run_bf16_linear(lib, x.reshape(rows, k), weight, bias)
            return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
    if weight_left and weight.dtype == torch.float32 and x.dtype == torch.float32 and rows >= 2:
        return weight_left_linear(x.reshape(rows, k), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if upcast_rows and weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and rows >= upcast_rows:
        out = sliced_upcast_linear(x.reshape(rows, k), weight, bias)
        return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
