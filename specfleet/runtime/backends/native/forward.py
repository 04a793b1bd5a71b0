"""The forward of a native GGUF model: every decoder layer of every row in one call into csrc/layers.c.

`model_fits` says whether a model can take this path (a property of the model, decided when its routes are
bound, so every step of a request takes the same path), `fused_layers_route` is the route bound to it and
`forward_native` runs it over the step's key plan
(runtime/step/plan.py). `runtime/model/decoder.py` holds the modules; this file is the bridge from them to C.
"""
from __future__ import annotations

import ctypes

import torch

from specfleet.runtime.model.attention import AttentionBatch
from specfleet.runtime.kv.cache import KVCache
from specfleet.runtime.step.plan import KeyPlan


def model_fits(model) -> bool:
    """Whether a model's layers can run `forward_native`: every linear layer of every decoder layer a
    QLinear wholly in block formats, no q/k norm, fp32 norms and rotary tables, the head shapes the C
    attention takes. A property of the model, so every step of a request (decode, verification,
    prefill) takes the same path."""
    if model.config.is_gemma3:  # the native layers compute a Llama/Qwen layer only
        return False
    from specfleet.runtime.formats.qlinear import QLinear

    def quantized(m) -> bool:
        return isinstance(m, QLinear) and m.all_quantized

    cfg = model.config
    return (cfg.head_dim % 32 == 0 and cfg.head_dim <= 512 and cfg.num_heads % cfg.num_kv_heads == 0
            and cfg.num_heads // cfg.num_kv_heads <= 16  # what the C attention takes
            and model.rotary.cos.dtype == torch.float32 and model.rotary.cos.is_contiguous()
            and all(quantized(layer.self_attn.qkv_proj) and quantized(layer.self_attn.o_proj)
                    and quantized(layer.mlp.gate_up_proj) and quantized(layer.mlp.down_proj)
                    and layer.self_attn.q_norm is None and layer.input_layernorm.weight.dtype == torch.float32
                    and layer.post_attention_layernorm.weight.dtype == torch.float32
                    for layer in model.layers))


def kv_fits(input_ids: torch.Tensor, kv: KVCache) -> bool:
    """Whether a step's inputs and KV cache are what the C layers read: CPU, an fp32 contiguous cache."""
    k0 = kv.k[0]
    return (input_ids.device.type == "cpu" and k0.dtype == torch.float32 and k0.device.type == "cpu"
            and k0.is_contiguous() and kv.v[0].is_contiguous())


def native_lib(model, input_ids: torch.Tensor, kv: KVCache):
    """The native library when this model can run `forward_native` over `kv`, else None."""
    if not kv_fits(input_ids, kv) or not model_fits(model):
        return None
    from specfleet.runtime.backends.native import kernels as native_backend

    return native_backend.library()


def fused_layers_route(model):
    """A model's `fused_layers` route (runtime/backends/bind.py): the forward of every decoder layer in one
    native call, or None where the model cannot take it or no library runs here (decided once, when the
    routes are bound). The route itself returns None for a cache the C layers cannot read, and the model
    then runs its modules."""
    if not model_fits(model):
        return None
    from specfleet.runtime.backends.native import kernels as native_backend

    lib = native_backend.library()
    if lib is None:
        return None

    def run(model, input_ids, positions, batch, kv):
        return forward_native(model, lib, input_ids, positions, batch, kv) if kv_fits(input_ids, kv) else None

    return run


def forward_native(model, lib, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                   kv: KVCache) -> torch.Tensor:
    """The forward of a native GGUF model, every decoder layer in one native call (csrc/layers.c,
    `specfleet_decode_layers`): per layer RMSNorm + q/k/v products + bias; rotary + KV cache write;
    attention of each row over the keys of the step's key plan (runtime/step/plan.py); o product
    added to the residual; RMSNorm + gate/up products; SiLU * up + down product added to the
    residual. Every one computes a row the same way whatever the other rows of the step (decode,
    prompt chunk, chain or tree), so a verified row is bit for bit its decode step."""
    cfg = model.config
    h = model.embed_tokens(input_ids).to(torch.float32).contiguous()  # a new tensor, updated in place below
    t = h.shape[0]
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pos = positions.to(torch.int64).contiguous()
    slots = batch.slot_mapping.to(torch.int64).contiguous()
    if t and (int(pos.min()) < 0 or int(pos.max()) >= model.rotary.cos.shape[0]):
        raise IndexError(f"positions must lie in [0, {model.rotary.cos.shape[0]})")
    if t and (int(slots.min()) < 0 or int(slots.max()) >= kv.k[0].shape[0]):
        raise IndexError(f"slot mapping must lie in [0, {kv.k[0].shape[0]})")
    first = model.layers[0]
    qkv = torch.empty((t, first.self_attn.qkv_proj.out_features), dtype=torch.float32)
    q = torch.empty((t, heads, d), dtype=torch.float32)
    o = torch.empty((t, heads, d), dtype=torch.float32)
    gu = torch.empty((t, first.mlp.gate_up_proj.out_features), dtype=torch.float32)
    cos, sin = model.rotary.cos, model.rotary.sin
    plan = batch.key_plan if batch.key_plan is not None else KeyPlan.build(batch)  # each row: its decode step's keys
    if len(plan.slots) and not 0 <= int(plan.slots.min()) <= int(plan.slots.max()) < kv.k[0].shape[0]:
        raise IndexError(f"the key plan's cache rows must lie in [0, {kv.k[0].shape[0]})")
    rc = lib.specfleet_decode_layers(
        ctypes.addressof(native_layers(model, kv)), len(model.layers), t, h.data_ptr(), cfg.hidden_size,
        qkv.data_ptr(), qkv.shape[1], q.data_ptr(), o.data_ptr(), gu.data_ptr(), gu.shape[1] // 2, heads,
        kv_heads, d, pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), *plan.c_args(),
        first.self_attn.scale, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the native decoder layers refused their arguments (code {rc})")
    return model.norm(h)

def native_layers(model, kv: KVCache):
    """The ctypes array of NativeLayer for `specfleet_decode_layers` over `kv` (made once per KV cache;
    it points into the layers' weights and the cache, which this model and `kv` keep alive)."""
    from specfleet.runtime.backends.native.kernels import NativeLayer

    key = tuple(c.data_ptr() for c in (*kv.k, *kv.v))
    cached = getattr(model, "_native_layers_cache", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    arr = (NativeLayer * len(model.layers))()
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        ps = [lin.native_parts() for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        arr[i] = NativeLayer(*(ctypes.addressof(p) for p in ps), *(len(p) for p in ps),
                             layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                             layer.input_layernorm.eps, layer.post_attention_layernorm.eps,
                             kv.k[i].data_ptr(), kv.v[i].data_ptr())
    model._native_layers_cache = (key, arr)
    return arr
