"""The CUDA route of the runtime, run on CPU tensors: `route_cuda_on_cpu(monkeypatch)` makes
runtime/backends/cuda/kernels.py say it applies to CPU tensors and replaces its three kernels with stand-ins that
compute what the Triton kernels compute, row by row (so a row's result never depends on the others of its
call, as on a GPU). Each stand-in is one registered operator, so a TorchDispatchMode counts a kernel launch
as one operation, as a GPU would see it. Everything else is the code a CUDA model runs: the runner's key
plan and its one upload, DevicePlan, the routing in the model's modules and in attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specfleet.runtime.backends.cuda import kernels as cuda_kernels


@torch.library.custom_op("specfleet_test::linear", mutates_args=())
def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    rows = [F.linear(x2[i:i + 1], w, bias) for i in range(x2.shape[0])]
    y = torch.cat(rows) if rows else x2.new_zeros(0, w.shape[0])
    return y.view(*x.shape[:-1], w.shape[0])


@torch.library.custom_op("specfleet_test::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(x2)
    for i in range(x2.shape[0]):
        r = x2[i].float()
        r = r * torch.rsqrt(r.pow(2).mean() + eps)
        out[i] = (r * (1.0 + weight.float())).to(x.dtype) if unit_offset else weight * r.to(x.dtype)
    return out.view(x.shape)


@torch.library.custom_op("specfleet_test::attend", mutates_args=())
def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, base: torch.Tensor,
            plen: torch.Tensor, xoff: torch.Tensor, nkeys: torch.Tensor, extras: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Row t attends to its plan's keys: layout indices 0..plen-1, then extras[xoff : xoff + nkeys - plen],
    each mapped to a cache row through slots[base + index]; unmasked, in that order."""
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    out = torch.empty_like(q)
    for r in range(t):
        p, n, b, x = int(plen[r]), int(nkeys[r]), int(base[r]), int(xoff[r])
        layout = torch.cat([torch.arange(p, device=q.device), extras[x:x + n - p]])
        rows = slots[b + layout]
        k = k_cache[rows].transpose(0, 1).repeat_interleave(h // kvh, dim=0)  # [H, n, D]
        v = v_cache[rows].transpose(0, 1).repeat_interleave(h // kvh, dim=0)
        out[r] = F.scaled_dot_product_attention(q[r].unsqueeze(1), k, v, scale=scale).squeeze(1)
    return out


def route_cuda_on_cpu(monkeypatch) -> None:
    """From now on (until monkeypatch undoes it) models built afterwards take the CUDA route on the CPU."""
    monkeypatch.setattr(cuda_kernels, "available", lambda device: True)
    monkeypatch.setattr(cuda_kernels, "linear", lambda x, w, bias=None: _linear(x, w, bias))
    # plain functions, as the real kernels are: a bound route is copied with its model (copy.deepcopy)
    monkeypatch.setattr(cuda_kernels, "rms_norm", lambda x, w, eps, unit_offset: _rms_norm(x, w, eps, unit_offset))
    monkeypatch.setattr(cuda_kernels, "attend",
                        lambda q, k, v, plan, scale: _attend(q, k, v, *plan, scale))
