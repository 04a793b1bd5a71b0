"""Batch-invariant CUDA kernels (Triton): a row's result never depends on the other rows of its call.

Why. cuBLAS picks its GEMM algorithm from the shape, so the rows of a verification step (M = 5..100) and the
one row of a decode step (M = 1) are summed in different orders, and a verified row's logits differ from its
decode step's in the last bits (measured on an H100: hundreds of rows in fp32, a few in bf16, on a tiny
model). At a near-tie the argmax flips and speculative output leaves plain output. The same holds for
torch's row reductions (RMSNorm) and for SDPA, whose kernel choice depends on the number of queries. So on
CUDA every operation that sums along a row runs here, with one fixed configuration for every row count:

- `linear`: x [M, K] @ w[N, K]^T (+ bias), a tiled product with fixed tiles and no split over K: each
  output element is the same chain of tile products whatever M is (M is not specialised on).
- `rms_norm`: one program per row.
- `attend`: one program per (query row, head) over the keys of the step's key plan (runtime/step/plan.py),
  in blocks of a fixed number of keys counted from the row's first key, with an online softmax. A verified
  row and the decode step of the same token see the same key list, so they run the same blocks in the same
  order; this is also the one batched attention call per layer for decode, verification and prompt chunks.

Elementwise operations (rotary, SiLU * up, residual adds) and gathers are invariant already. Kernels compile
on first use (Triton ships with CUDA builds of torch); `available()` says whether they can run.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

_triton = None
_why_not: str | None = None
BM, BN, BK = 32, 64, 64  # the one tiling of `linear`: every row count uses it
BLOCK_KEYS = 32  # keys per block of `attend`


def _load():
    global _triton, _why_not
    if _triton is None and _why_not is None:
        try:
            import triton  # noqa: F401

            _triton = _build()
        except Exception as e:  # no triton (CPU builds of torch), or it cannot compile here
            _why_not = f"{type(e).__name__}: {e}"
    return _triton


def available(device: torch.device) -> bool:
    """Whether tensors on `device` can go through these kernels (CUDA, Triton importable); a model's
    RuntimeConfig.cuda_kernels says whether they do."""
    return device.type == "cuda" and _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _why_not


def _build():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym,
                      HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :].to(tl.int64) * swn + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None].to(tl.int64) * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def rms_kernel(x_ptr, w_ptr, y_ptr, H, sx, sy, eps, UNIT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        xn = x * r
        if UNIT:  # Gemma: (1 + w) * x, the product in fp32
            y = xn * (1.0 + w.to(tl.float32))
        else:  # Llama: w * x, the product in the activation dtype (each factor rounded to it first)
            y = w.to(y_ptr.dtype.element_ty).to(tl.float32) * xn.to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + row * sy + cols, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def attend_kernel(q_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, base_ptr, plen_ptr, xoff_ptr, nkeys_ptr, extras_ptr,
                      sqt, sqh, sks, skh, svs, svh, sot, soh, scale,
                      GROUP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        d = tl.arange(0, BD)
        dm = d < D
        q = tl.load(q_ptr + row.to(tl.int64) * sqt + h * sqh + d, mask=dm, other=0.0).to(tl.float32)
        base = tl.load(base_ptr + row)
        plen = tl.load(plen_ptr + row)
        xoff = tl.load(xoff_ptr + row)
        n = tl.load(nkeys_ptr + row)
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros((BD,), dtype=tl.float32)
        for j0 in range(0, n, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            valid = j < n
            pre = j < plen
            extra = tl.load(extras_ptr + xoff + (j - plen), mask=valid & (j >= plen), other=0)
            x = tl.where(pre, j, extra)
            slot = tl.load(slots_ptr + base + x, mask=valid, other=0)
            kmask = valid[:, None] & dm[None, :]
            k = tl.load(k_ptr + slot[:, None] * sks + kvh * skh + d[None, :], mask=kmask, other=0.0).to(tl.float32)
            s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            v = tl.load(v_ptr + slot[:, None] * svs + kvh * svh + d[None, :], mask=kmask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        tl.store(o_ptr + row.to(tl.int64) * sot + h * soh + d, (acc / l_i).to(o_ptr.dtype.element_ty), mask=dm)

    return {"linear": linear_kernel, "rms": rms_kernel, "attend": attend_kernel, "triton": triton}


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias) in x's dtype, fp32 accumulation, every row summed the same way."""
    k = _load()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    m, kdim = x2.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m:
        grid = (k["triton"].cdiv(m, BM), k["triton"].cdiv(n, BN))
        k["linear"][grid](x2, w, bias if bias is not None else w, y, m, n, kdim, x2.stride(0), w.stride(0),
                          y.stride(0), HAS_BIAS=bias is not None, IEEE=x2.dtype == torch.float32,
                          BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=4, num_stages=3)
    return y.view(*lead, n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm over the last dimension, one program per row (see model.RMSNorm for the two variants)."""
    k = _load()
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        k["rms"][(x2.shape[0],)](x2, weight, y, h, x2.stride(0), y.stride(0), eps, UNIT=unit_offset,
                                 BLOCK=k["triton"].next_power_of_2(h), num_warps=4)
    return y.view(x.shape)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: "DevicePlan",
           scale: float) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]: row t, head h attends to the keys of the plan's row t in
    k_cache/v_cache [slots, KVH, D] (KV head h // (H / KVH)), unmasked."""
    kern = _load()
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    out = torch.empty_like(q)
    if t:
        kern["attend"][(t, h)](q, k_cache, v_cache, out, plan.slots, plan.base, plan.plen, plan.xoff, plan.nkeys,
                               plan.extras, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                               v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), scale,
                               GROUP=h // kvh, D=d, BD=kern["triton"].next_power_of_2(d), BLOCK=BLOCK_KEYS,
                               num_warps=1)
    return out


class DevicePlan(NamedTuple):
    """A step's key plan (runtime/step_plan.KeyPlan) on the device: its six arrays, moved in one copy."""

    slots: torch.Tensor
    base: torch.Tensor
    plen: torch.Tensor
    xoff: torch.Tensor
    nkeys: torch.Tensor
    extras: torch.Tensor

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """`attend` over this plan (the model's attention calls it without importing this backend)."""
        return attend(q, k_cache, v_cache, self, scale)
