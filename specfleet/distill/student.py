"""The draft being trained: a DecoderLM body plus an output head over a reduced vocabulary.

Reduced vocabulary, and why the saved model is still an ordinary full-vocabulary model:
the head predicts K token ids (`vocab_ids`) during training. The runtime's head is bias-free, so the
exported `lm_head` keeps those K rows and sets every other row to zero: each out-of-set token gets
logit exactly 0, whatever the hidden state. Training sees the same thing in aggregate: besides the
K logits it has one constant "other" class with logit log(V - K), the log-sum-exp of V - K zeros.
So the training softmax is exactly the exported model's softmax with the out-of-set tokens pooled,
and the loss we minimise is the exported model's loss (up to a constant on out-of-set labels).
Worked example: V = 5, K = 2, vocab_ids = [3, 1], in-set logits [2.0, -1.0] -> exported logits
[0, -1.0, 0, 2.0, 0]; training sees [2.0, -1.0, log 3], which pools the three zeros.
Greedy drafting picks an out-of-set token only when every in-set logit is below 0; such a token is
then almost surely rejected. Speculative decoding stays lossless either way: the target verifies
every drafted token, so the draft's vocabulary only moves acceptance, never the output.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from specfleet.runtime.model.decoder import DecoderLM
from specfleet.runtime.model.config import ModelConfig


@dataclass(frozen=True)
class StudentSpec:
    """Everything that fixes the student's shape and initialisation; a resumed run must match it."""

    init_from: str  # "none" or the model the weights come from
    layer_ids: tuple[int, ...]  # source layers copied into the student, in order; () = random layers
    config: dict  # ModelConfig.as_dict() of the exported (untied, full-vocabulary) draft
    vocab_size: int  # K classes the head predicts (== config vocab_size when not reduced)
    freeze_embeddings: bool
    freeze_head: bool

    def model_config(self) -> ModelConfig:
        d = dict(self.config)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return ModelConfig(**d)

    def as_dict(self) -> dict:
        return asdict(self)


def causal_forward(body: DecoderLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Differentiable full-sequence forward over right-padded rows: [B, T] ids -> [B, T, hidden].

    The runtime's forward is paged and inference-only; this one reuses the same modules with plain
    causal attention. Padding sits after the real tokens, so causality alone keeps it invisible.
    """
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).repeat(b)  # [B*T], rows flattened
    h = body.embed_tokens(input_ids)
    for layer in body.layers:
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), positions, body)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return body.norm(h)


def _attention(attn, x: torch.Tensor, positions: torch.Tensor, body: DecoderLM) -> torch.Tensor:
    b, t, _ = x.shape
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.reshape(b * t, attn.num_heads, attn.head_dim)
    k = k.reshape(b * t, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = body.rotary(q, positions), body.rotary(k, positions)
    q = q.view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)  # [B, heads, T, D]
    k = k.view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = v.reshape(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale,
                                       enable_gqa=attn.num_heads != attn.num_kv_heads)
    return attn.o_proj(o.transpose(1, 2).reshape(b, t, attn.q_size))


class Student(nn.Module):
    def __init__(self, spec: StudentSpec, vocab_ids: torch.Tensor | None):
        super().__init__()
        self.spec = spec
        cfg = spec.model_config()
        # tied config: no full-vocabulary lm_head is allocated; `head` below replaces it
        self.body = DecoderLM(replace(cfg, tie_word_embeddings=True))
        num_classes = cfg.vocab_size if vocab_ids is None else len(vocab_ids)
        self.head = nn.Parameter(torch.zeros(num_classes, cfg.hidden_size))
        self.is_reduced = vocab_ids is not None
        ids = vocab_ids if vocab_ids is not None else torch.arange(cfg.vocab_size)
        self.register_buffer("vocab_ids", ids.long(), persistent=False)
        # class index of each token id; out-of-set ids map to the pooled class K
        class_of = torch.full((cfg.vocab_size,), num_classes, dtype=torch.long)
        class_of[ids] = torch.arange(num_classes)
        self.register_buffer("class_of", class_of, persistent=False)
        self.other_logit = math.log(cfg.vocab_size - num_classes) if self.is_reduced else None

    @property
    def num_classes(self) -> int:
        """Classes of the training softmax: K, plus the pooled out-of-set class when reduced."""
        return self.head.shape[0] + (1 if self.is_reduced else 0)

    def class_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., num_classes]
        logits = F.linear(hidden, self.head)
        if not self.is_reduced:
            return logits
        other = logits.new_full((*logits.shape[:-1], 1), self.other_logit)
        return torch.cat([logits, other], dim=-1)

    def greedy_correct(self, class_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Whether the exported model's argmax is the label: an in-set label must win among the K
        logits and beat 0, the logit of every out-of-set token; out-of-set labels count as misses."""
        in_set = class_logits[..., :self.head.shape[0]]
        best, arg = in_set.max(-1)
        ok = arg == labels
        if self.is_reduced:
            ok &= best > 0
        return ok

    def configure_trainable(self) -> None:
        self.body.embed_tokens.weight.requires_grad_(not self.spec.freeze_embeddings)
        self.head.requires_grad_(not self.spec.freeze_head)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.named_parameters() if p.requires_grad}

    # -- export ----------------------------------------------------------------------------------
    def export_weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Hugging Face-named tensors of the full-vocabulary, untied draft (q/k/v and gate/up split)."""
        body = self.body
        cfg = self.spec.model_config()
        out = {"model.embed_tokens.weight": body.embed_tokens.weight, "model.norm.weight": body.norm.weight}
        head = torch.zeros(cfg.vocab_size, cfg.hidden_size)
        head[self.vocab_ids] = self.head.detach()
        out["lm_head.weight"] = head
        for i, layer in enumerate(body.layers):
            p, a = f"model.layers.{i}.", layer.self_attn
            sizes = [a.q_size, a.kv_size, a.kv_size]
            for name, w in zip(("q", "k", "v"), a.qkv_proj.weight.split(sizes)):
                out[f"{p}self_attn.{name}_proj.weight"] = w
            if a.qkv_proj.bias is not None:
                for name, bias in zip(("q", "k", "v"), a.qkv_proj.bias.split(sizes)):
                    out[f"{p}self_attn.{name}_proj.bias"] = bias
            if a.q_norm is not None:
                out[p + "self_attn.q_norm.weight"] = a.q_norm.weight
                out[p + "self_attn.k_norm.weight"] = a.k_norm.weight
            out[p + "self_attn.o_proj.weight"] = a.o_proj.weight
            gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        return {n: t.detach().to(dtype).clone().contiguous() for n, t in out.items()}  # no shared storage
