"""The project's own forward pass for Llama-family decoder-only models (Llama/SmolLM2, Qwen2, Qwen3)
and Gemma-3.

Weights keep their Hugging Face names at load time; q/k/v and gate/up projections are fused into
one matmul each, which matters on the CPU where per-call overhead is a visible share of a decode step.
Numerics follow the reference implementation (RMSNorm in fp32, rotary tables cast to the activation
dtype) so fp32 logits agree with transformers to rounding.

Gemma-3 on the same modules (`ModelConfig.is_gemma3`): embeddings times sqrt(hidden_size); RMSNorm
scaling by (1 + weight), the product taken in fp32 before the cast; q/k RMSNorm per head; a norm on the
attention output and on the MLP output before each residual add (`post_attention_layernorm` is that
first one in Gemma's naming, and `pre_feedforward_layernorm` the MLP's input norm); a GELU (tanh)
gated MLP; attention scaled by query_pre_attn_scalar ** -0.5; sliding-window layers (keys older than
the window masked, runtime/model/attention.py) with their own rotary base, interleaved with global layers
(whose rotary may scale positions linearly).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specfleet.runtime.config import RuntimeConfig
from specfleet.runtime.kv.cache import KVCache
from specfleet.runtime.model.attention import AttentionBatch, paged_attention
from specfleet.runtime.model.config import ModelConfig

DEFAULT_RUNTIME = RuntimeConfig()  # what a model computes with until set_runtime hands it another


class Linear(nn.Linear):
    """nn.Linear whose product goes through its bound route (runtime/backends/bind.py: the CPU routes,
    the batch-invariant CUDA kernel or torch's); same weights. Unbound, it is torch's `F.linear`."""

    route = staticmethod(F.linear)  # (x, weight, bias) -> y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.route(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (weight * normalized x, the product in the activation dtype) or, with
    `unit_offset`, Gemma's ((1 + weight) * normalized x, the product in fp32; the weight is stored as
    Hugging Face stores it, without the 1)."""

    route = None  # bound (runtime/backends/bind.py) to a kernel (x, weight, eps, unit_offset) -> y; None: the torch body

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.route is not None:
            return self.route(x, self.weight, self.eps, self.unit_offset)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (positions of tree nodes are depths).
    `scaling` > 1 is linear position scaling (position / scaling), as Gemma-3's global layers use."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: float = 1.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling != 1.0:
            inv_freq = inv_freq / scaling
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._last: tuple | None = None  # (positions, dtype, cos, sin) of the last call

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of `positions` in `dtype`, [T, 1, D]. Every layer of a forward passes the same positions
        tensor (q and k too), so they are gathered once per forward, not twice per layer (on CUDA, where each
        operation is a launch, that was a quarter of a decode step of a small model)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype and last[2].device == positions.device:
            return last[2], last[3]
        cos = self.cos[positions].to(dtype).unsqueeze(1)
        sin = self.sin[positions].to(dtype).unsqueeze(1)
        self._last = (positions, dtype, cos, sin)  # holds `positions`, so its identity is not reused meanwhile
        return cos, sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [T, heads, D]
        cos, sin = self._tables(positions, x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def make_rotaries(cfg: ModelConfig) -> tuple[Rotary, Rotary | None]:
    """The model's rotary tables: the full-attention layers' and, when the sliding-window layers use
    another one (Gemma-3), theirs (else None)."""
    full = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling_factor)
    if not any(cfg.layer_window(i) for i in range(cfg.num_layers)):
        return full, None
    theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    return full, Rotary(cfg.head_dim, theta, cfg.max_position_embeddings)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        gemma = cfg.is_gemma3
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, gemma) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, gemma) if cfg.qk_norm else None
        self.scale = cfg.attention_scale
        self.window = cfg.layer_window(index)  # a sliding-window layer's window, else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, batch: AttentionBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, positions), rotary(k, positions)
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
        o = paged_attention(q, k_cache, v_cache, batch, self.scale, window=self.window)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class DecoderLayer(nn.Module):
    """Llama/Qwen: h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h)).
    Gemma-3 (four norms, Hugging Face's names): h += post_attention_layernorm(attn(input_layernorm(h)));
    h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        gemma = cfg.is_gemma3
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)
        self.mlp = MLP(cfg)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True) if gemma else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True) if gemma else None


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.is_gemma3)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary, self.rotary_local = make_rotaries(cfg)  # rotary_local: the sliding layers' (Gemma-3)
        self.head_q = None  # an int8 head after runtime.quant.quantize_model
        self.quantization: str | None = None
        self.runtime = DEFAULT_RUNTIME
        # The compute routes, fixed by runtime/backends/bind.py when the model is built, when a runner takes it
        # and when set_runtime replaces its RuntimeConfig (the model imports no backend): the output head's
        # product, and the native layers (every decoder layer in one C call) where this model can take them.
        self.head_route = F.linear
        self.fused_layers = None  # (model, input_ids, positions, batch, kv) -> hidden, or None to run the modules
        self.binder = None  # (model) -> None: binds the routes again (set by bind, called by set_runtime)

    def set_runtime(self, runtime: RuntimeConfig) -> "DecoderLM":
        """Compute with `runtime` from now on: the routes of every layer (including any the loader or a
        quantizer put in since) are bound again."""
        self.runtime = runtime
        if self.binder is not None:
            self.binder(self)
        return self

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv: KVCache) -> torch.Tensor:  # -> hidden [num_tokens, hidden]
        if self.fused_layers is not None:
            hidden = self.fused_layers(self, input_ids, positions, batch, kv)
            if hidden is not None:
                return hidden
        h = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # Gemma: the factor in the activation dtype, as transformers does
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            rotary = self.rotary_local if attn.window is not None and self.rotary_local is not None else self.rotary
            residual = h
            h = attn(layer.input_layernorm(h), positions, rotary, batch, kv.k[i], kv.v[i])
            if layer.pre_feedforward_layernorm is None:
                h = residual + h
                residual = h
                h = residual + layer.mlp(layer.post_attention_layernorm(h))
            else:  # Gemma-3: norms on the attention and MLP outputs too
                h = residual + layer.post_attention_layernorm(h)
                h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        return self.norm(h)

    def init_rotary(self, device: torch.device | str) -> None:
        """Build the rotary tables (non-persistent buffers: a model made on the meta device, or from a
        state dict, has none yet) in fp32 on `device`."""
        self.rotary, self.rotary_local = (r if r is None else r.to(device) for r in make_rotaries(self.config))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, vocab_limit: int | None = None) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] fp32 logits; with `vocab_limit` only token ids below it (a draft's
        cheaper head: byte-level BPE ids are roughly in merge order, so low ids are the common tokens)."""
        if self.head_q is not None:
            return self.head_q.matmul(hidden, vocab_limit).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if vocab_limit is not None:
            weight = weight[:vocab_limit]
        return self.head_route(hidden, weight, None).float()
