"""Attention over a ragged batch whose keys and values live in a paged KV cache.

A ragged batch packs the new tokens of many requests into one [num_tokens, ...] tensor with no
padding. Request i contributes `query_lens[i]` new tokens placed after `context_lens[i]` tokens
already cached. Its queries attend to its own cached tokens and, among its new tokens, to those
allowed by its mask: causal by default, or any [new, new] boolean mask (a draft tree's ancestor
mask). Nothing ever attends across requests.

Grouped-query attention is computed without repeating K/V: the G = num_heads / num_kv_heads query
heads that share one KV head are folded into the query-row dimension, so each KV head does one
[n*G, L] attention. For decode (n = 1) that needs no mask at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionBatch:
    """Per-step attention layout, built once per step by the model runner and shared by all layers."""

    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    kv_indices: list[torch.Tensor]  # per request: [context + new] flat slots of its whole sequence
    masks: list[torch.Tensor | None]  # per request: [new, context + new] bool (True = visible), None = no mask needed


def build_visibility_mask(context_len: int, new_mask: torch.Tensor) -> torch.Tensor:
    """[new, new] mask over new tokens -> [new, context + new] mask that also sees the whole context."""
    n = new_mask.shape[0]
    full = torch.ones(n, context_len + n, dtype=torch.bool, device=new_mask.device)
    full[:, context_len:] = new_mask
    return full


def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotary already applied
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], new keys already written
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for n, idx, mask in zip(batch.query_lens, batch.kv_indices, batch.masks):
        qi = q[start:start + n]  # [n, H, D]
        # fold the query heads of each KV group into rows: [KVH, n*G, D], row order (token, group)
        qi = qi.view(n, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv_heads, n * group, head_dim)
        ki = k_cache.index_select(0, idx).transpose(0, 1)  # [KVH, L, D]
        vi = v_cache.index_select(0, idx).transpose(0, 1)
        m = None if mask is None else mask.repeat_interleave(group, dim=0)  # [n*G, L]
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=m, scale=scale)  # [KVH, n*G, D]
        out[start:start + n] = oi.view(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3).reshape(n, -1, head_dim)
        start += n
    return out
