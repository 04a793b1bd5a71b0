"""Tiny random-weight reference models built with transformers, shared by the tests."""
from __future__ import annotations

import torch
import transformers

from specfleet.runtime.model.decoder import DecoderLM
from specfleet.runtime.loading.weights import load_weights
from specfleet.runtime.model.config import ModelConfig

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)

# Gemma-3: a window of 5 keys, far shorter than the test contexts; sliding and global layers with
# different rotary bases; an attention scale other than head_dim ** -0.5; four heads on two KV heads
GEMMA3 = dict(num_hidden_layers=4, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
              tie_word_embeddings=True, attn_implementation="eager")


def tiny_hf_model(arch: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    kw = {**TINY, **(GEMMA3 if arch == "gemma3" else {}), **overrides}
    if arch == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, rope_theta=10000.0, **kw)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=False, rope_theta=1000000.0, **kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(tie_word_embeddings=False, head_dim=16, **kw)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(**kw)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # random init leaves biases and norms at trivial values; perturb them so the test sees them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval().float()


def ours_from_hf(model: transformers.PreTrainedModel) -> DecoderLM:
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    ours = DecoderLM(cfg)
    load_weights(ours, dict(model.state_dict()))
    return ours.eval()


def perturbed_copy(model: DecoderLM, scale: float, seed: int = 0) -> DecoderLM:
    """A draft that agrees with `model` only partly: the same weights plus relative noise."""
    import copy

    g = torch.Generator().manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean())
    return draft


class LetterTokenizer:
    """A tokenizer for tiny random models: token t is one letter, so every token is a chunk of text (a stream
    yields each one)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)

    def encode(self, text, add_special_tokens=True):
        return [ord(c) - ord("a") for c in text if "a" <= c <= "z"]

    def apply_chat_template(self, messages, **kwargs):
        raise NotImplementedError  # no chat here

    def convert_ids_to_tokens(self, ids):
        return self.decode([ids]) if isinstance(ids, int) else [self.decode([t]) for t in ids]


def random_prompts(lengths: list[int], vocab: int = 97, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_to_completion(engine, prompts, params) -> list:
    """Submit all prompts, step until done, return the final RequestOutputs in prompt order."""
    reqs = [engine.add_request(p, params if not isinstance(params, list) else params[i])
            for i, p in enumerate(prompts)]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[r.request_id] for r in reqs]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool over a draft tree's nodes (parent -1: under the root): row i sees itself and its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask
