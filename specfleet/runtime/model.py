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
the window masked, runtime/attention.py) with their own rotary base, interleaved with global layers
(whose rotary may scale positions linearly).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from specfleet.errors import ModelLoadError
from specfleet.runtime.cpu_linear import cpu_linear, default_native_rows, default_upcast_rows, default_weight_left
from specfleet.runtime.attention import AttentionBatch, paged_attention
from specfleet.runtime.kv_cache import KVCache
from specfleet.runtime.model_config import ModelConfig
from specfleet.runtime.step_plan import KeyPlan


UPCAST_ROWS = default_upcast_rows()  # read per call, so tests and benchmarks may change them
WEIGHT_LEFT = default_weight_left()
NATIVE_ROWS = default_native_rows()
# Native GGUF models (every linear layer a block-format QLinear, fp32 activations, CPU) run each
# decoder layer as a few calls into csrc/q_fused.c (`DecoderLM._forward_native`); False keeps the
# module-by-module forward (benchmarks compare the two). Read per call.
FUSED_NATIVE = True


class Linear(nn.Linear):
    """nn.Linear whose CPU products take the faster routes of runtime/cpu_linear.py; same weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return cpu_linear(x, self.weight, self.bias, UPCAST_ROWS, WEIGHT_LEFT, NATIVE_ROWS)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (weight * normalized x, the product in the activation dtype) or, with
    `unit_offset`, Gemma's ((1 + weight) * normalized x, the product in fp32; the weight is stored as
    Hugging Face stores it, without the 1)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [T, heads, D]
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
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

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv: KVCache) -> torch.Tensor:  # -> hidden [num_tokens, hidden]
        lib = self._native_lib(input_ids, kv) if FUSED_NATIVE else None
        if lib is not None:
            return self._forward_native(lib, input_ids, positions, batch, kv)
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

    def _native_lib(self, input_ids: torch.Tensor, kv: KVCache):
        """The native library when this model can run `_forward_native` (every linear layer of every
        decoder layer a QLinear wholly in block formats, no q/k norm, fp32 CPU KV cache), else None.
        Whether it can is a property of the model, so every step of a request (decode, verification,
        prefill) takes the same path."""
        if self.config.is_gemma3:  # the native layers compute a Llama/Qwen layer only
            return None
        k0 = kv.k[0]
        if input_ids.device.type != "cpu" or k0.dtype != torch.float32 or k0.device.type != "cpu" or not all(
                c.is_contiguous() for c in (k0, kv.v[0])):
            return None
        ok = getattr(self, "_native_ok", None)
        if ok is None:
            from specfleet.runtime.qlinear import QLinear

            def quantized(m) -> bool:
                return isinstance(m, QLinear) and m.all_quantized

            cfg = self.config
            ok = (cfg.head_dim % 32 == 0 and cfg.head_dim <= 512 and cfg.num_heads % cfg.num_kv_heads == 0
                  and cfg.num_heads // cfg.num_kv_heads <= 16  # what the C attention takes
                  and self.rotary.cos.dtype == torch.float32 and self.rotary.cos.is_contiguous()
                  and all(quantized(layer.self_attn.qkv_proj) and quantized(layer.self_attn.o_proj)
                          and quantized(layer.mlp.gate_up_proj) and quantized(layer.mlp.down_proj)
                          and layer.self_attn.q_norm is None and layer.input_layernorm.weight.dtype == torch.float32
                          and layer.post_attention_layernorm.weight.dtype == torch.float32
                          for layer in self.layers))
            self._native_ok = ok
        if not ok:
            return None
        from specfleet.runtime import qtensor

        return qtensor._get()

    def _forward_native(self, lib, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                        kv: KVCache) -> torch.Tensor:
        """The forward of a native GGUF model, every decoder layer in one native call (csrc/q_fused.c,
        `specfleet_decode_layers`): per layer RMSNorm + q/k/v products + bias; rotary + KV cache write;
        attention of each row over the keys of the step's key plan (runtime/step_plan.py); o product
        added to the residual; RMSNorm + gate/up products; SiLU * up + down product added to the
        residual. Every one computes a row the same way whatever the other rows of the step (decode,
        prompt chunk, chain or tree), so a verified row is bit for bit its decode step."""
        cfg = self.config
        h = self.embed_tokens(input_ids).to(torch.float32).contiguous()  # a new tensor, updated in place below
        t = h.shape[0]
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pos = positions.to(torch.int64).contiguous()
        slots = batch.slot_mapping.to(torch.int64).contiguous()
        if t and (int(pos.min()) < 0 or int(pos.max()) >= self.rotary.cos.shape[0]):
            raise IndexError(f"positions must lie in [0, {self.rotary.cos.shape[0]})")
        if t and (int(slots.min()) < 0 or int(slots.max()) >= kv.k[0].shape[0]):
            raise IndexError(f"slot mapping must lie in [0, {kv.k[0].shape[0]})")
        first = self.layers[0]
        qkv = torch.empty((t, first.self_attn.qkv_proj.out_features), dtype=torch.float32)
        q = torch.empty((t, heads, d), dtype=torch.float32)
        o = torch.empty((t, heads, d), dtype=torch.float32)
        gu = torch.empty((t, first.mlp.gate_up_proj.out_features), dtype=torch.float32)
        cos, sin = self.rotary.cos, self.rotary.sin
        plan = KeyPlan.build(batch)  # every row over exactly the keys its decode step would see
        if len(plan.slots) and not 0 <= int(plan.slots.min()) <= int(plan.slots.max()) < kv.k[0].shape[0]:
            raise IndexError(f"the key plan's cache rows must lie in [0, {kv.k[0].shape[0]})")
        rc = lib.specfleet_decode_layers(
            ctypes.addressof(self._native_layers(kv)), len(self.layers), t, h.data_ptr(), cfg.hidden_size,
            qkv.data_ptr(), qkv.shape[1], q.data_ptr(), o.data_ptr(), gu.data_ptr(), gu.shape[1] // 2, heads,
            kv_heads, d, pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), *plan.c_args(),
            first.self_attn.scale, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the native decoder layers refused their arguments (code {rc})")
        return self.norm(h)

    def _native_layers(self, kv: KVCache):
        """The ctypes array of NativeLayer for `specfleet_decode_layers` over `kv` (made once per KV cache;
        it points into the layers' weights and the cache, which this model and `kv` keep alive)."""
        from specfleet.runtime.qtensor import NativeLayer

        key = tuple(c.data_ptr() for c in (*kv.k, *kv.v))
        cached = getattr(self, "_native_layers_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        arr = (NativeLayer * len(self.layers))()
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            ps = [lin.native_parts() for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            arr[i] = NativeLayer(*(ctypes.addressof(p) for p in ps), *(len(p) for p in ps),
                                 layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                                 layer.input_layernorm.eps, layer.post_attention_layernorm.eps,
                                 kv.k[i].data_ptr(), kv.v[i].data_ptr())
        self._native_layers_cache = (key, arr)
        return arr

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, vocab_limit: int | None = None) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] fp32 logits; with `vocab_limit` only token ids below it (a draft's
        cheaper head: byte-level BPE ids are roughly in merge order, so low ids are the common tokens)."""
        if self.head_q is not None:
            return self.head_q.matmul(hidden, vocab_limit).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if vocab_limit is not None:
            weight = weight[:vocab_limit]
        if hidden.device.type == "cpu":
            return cpu_linear(hidden, weight, None, UPCAST_ROWS, WEIGHT_LEFT, NATIVE_ROWS).float()
        return F.linear(hidden, weight).float()

    def install_quantized(self, weights: dict) -> None:
        """Replace each linear layer, the embedding and the head whose checkpoint weight is a QTensor (a GGUF
        block format, runtime/qtensor.py) by a QLinear / QEmbedding (runtime/qlinear.py) holding it as it is.

        Works on a model still on the meta device, so the dense parameters it replaces are never
        allocated. q/k/v and gate/up form one QLinear when any of them is quantized (it fuses what it can).
        """
        if all(isinstance(w, torch.Tensor) for w in weights.values()):
            return  # a dense checkpoint
        from specfleet.runtime.qlinear import QEmbedding, QLinear
        from specfleet.runtime.qtensor import QTensor

        def quantized(*names: str) -> bool:
            return any(isinstance(weights.get(n), QTensor) for n in names)

        def linear(names: list[str], bias_names: list[str] | None) -> QLinear:
            missing = [n for n in names + (bias_names or []) if n not in weights]
            if missing:
                raise ModelLoadError(f"checkpoint is missing tensor(s) {missing}")
            bias = torch.cat([weights[n].float() for n in bias_names]) if bias_names else None
            return QLinear([weights[n] for n in names], bias)

        bias = self.config.attention_bias
        for i, layer in enumerate(self.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = [a + f"{n}_proj.weight" for n in "qkv"]
            if quantized(*qkv):
                layer.self_attn.qkv_proj = linear(qkv, [a + f"{n}_proj.bias" for n in "qkv"] if bias else None)
            if quantized(a + "o_proj.weight"):
                layer.self_attn.o_proj = linear([a + "o_proj.weight"], None)
            if quantized(m + "gate_proj.weight", m + "up_proj.weight"):
                layer.mlp.gate_up_proj = linear([m + "gate_proj.weight", m + "up_proj.weight"], None)
            if quantized(m + "down_proj.weight"):
                layer.mlp.down_proj = linear([m + "down_proj.weight"], None)
        embed = weights.get("model.embed_tokens.weight")
        head_name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        if quantized(head_name):
            self.head_q = linear([head_name], None)
            self.lm_head = None
        if isinstance(embed, QTensor):
            self.embed_tokens = QEmbedding(embed)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up; every parameter must be covered.
        QTensor weights install quantized modules first (`install_quantized`); the rest fill dense parameters."""
        self.install_quantized(weights)
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            param = own[name]
            if param.shape != tensor.shape:
                raise ModelLoadError(f"weight {name}: checkpoint shape {tuple(tensor.shape)}, "
                                     f"model expects {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
            return weights[name]

        def dense(module: nn.Module) -> bool:  # not replaced by install_quantized
            return isinstance(module, nn.Linear)

        if isinstance(self.embed_tokens, nn.Embedding):
            put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            attn, mlp = layer.self_attn, layer.mlp
            if dense(attn.qkv_proj):
                put(f"layers.{i}.self_attn.qkv_proj.weight",
                    torch.cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")]))
                if attn.qkv_proj.bias is not None:
                    put(f"layers.{i}.self_attn.qkv_proj.bias",
                        torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")]))
            if dense(attn.o_proj):
                put(f"layers.{i}.self_attn.o_proj.weight", take(a + "o_proj.weight"))
            if attn.q_norm is not None:
                put(f"layers.{i}.self_attn.q_norm.weight", take(a + "q_norm.weight"))
                put(f"layers.{i}.self_attn.k_norm.weight", take(a + "k_norm.weight"))
            m = p + "mlp."
            if dense(mlp.gate_up_proj):
                put(f"layers.{i}.mlp.gate_up_proj.weight",
                    torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]))
            if dense(mlp.down_proj):
                put(f"layers.{i}.mlp.down_proj.weight", take(m + "down_proj.weight"))
            put(f"layers.{i}.input_layernorm.weight", take(p + "input_layernorm.weight"))
            put(f"layers.{i}.post_attention_layernorm.weight", take(p + "post_attention_layernorm.weight"))
            if layer.pre_feedforward_layernorm is not None:
                put(f"layers.{i}.pre_feedforward_layernorm.weight", take(p + "pre_feedforward_layernorm.weight"))
                put(f"layers.{i}.post_feedforward_layernorm.weight", take(p + "post_feedforward_layernorm.weight"))
        missing = set(dict(self.named_parameters())) - loaded
        if missing:
            raise ModelLoadError(f"parameters not covered by the checkpoint: {sorted(missing)[:5]}")
