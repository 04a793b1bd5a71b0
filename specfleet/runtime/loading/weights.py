"""Loading a checkpoint's tensors into a DecoderLM: dense parameters (q/k/v and gate/up fused into one matrix
each) and GGUF block-format weights installed as QLinear/QEmbedding modules as they are.

`runtime/model/decoder.py` holds the modules only; building a model from a checkpoint is runtime/loading/build.py, which
calls `install_quantized` on the meta device (so replaced dense parameters are never allocated) and then
`load_weights`.
"""
from __future__ import annotations

import torch
from torch import nn

from specfleet.errors import ModelLoadError
from specfleet.runtime.model.decoder import DecoderLM


def install_quantized(model: DecoderLM, weights: dict) -> None:
    """Replace each linear layer, the embedding and the head whose checkpoint weight is a QTensor (a GGUF
    block format, runtime/formats/qtensor.py) by a QLinear / QEmbedding (runtime/formats/qlinear.py) holding it as it is.

    Works on a model still on the meta device, so the dense parameters it replaces are never
    allocated. q/k/v and gate/up form one QLinear when any of them is quantized (it fuses what it can).
    """
    if all(isinstance(w, torch.Tensor) for w in weights.values()):
        return  # a dense checkpoint
    from specfleet.runtime.formats.qlinear import QEmbedding, QLinear
    from specfleet.runtime.formats.qtensor import QTensor

    def quantized(*names: str) -> bool:
        return any(isinstance(weights.get(n), QTensor) for n in names)

    def linear(names: list[str], bias_names: list[str] | None) -> QLinear:
        missing = [n for n in names + (bias_names or []) if n not in weights]
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensor(s) {missing}")
        bias = torch.cat([weights[n].float() for n in bias_names]) if bias_names else None
        return QLinear([weights[n] for n in names], bias)

    bias = model.config.attention_bias
    for i, layer in enumerate(model.layers):
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
    head_name = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    if quantized(head_name):
        model.head_q = linear([head_name], None)
        model.lm_head = None
    if isinstance(embed, QTensor):
        model.embed_tokens = QEmbedding(embed)

def load_weights(model: DecoderLM, weights: dict[str, torch.Tensor]) -> None:
    """Load Hugging Face-named tensors, fusing q/k/v and gate/up; every parameter must be covered.
    QTensor weights install quantized modules first (`install_quantized`); the rest fill dense parameters."""
    install_quantized(model, weights)
    own = dict(model.named_parameters())
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

    if isinstance(model.embed_tokens, nn.Embedding):
        put("embed_tokens.weight", take("model.embed_tokens.weight"))
    put("norm.weight", take("model.norm.weight"))
    if model.lm_head is not None:
        put("lm_head.weight", take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
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
    missing = set(dict(model.named_parameters())) - loaded
    if missing:
        raise ModelLoadError(f"parameters not covered by the checkpoint: {sorted(missing)[:5]}")
