"""Architecture description of a decoder-only transformer, independent of where weights come from.

A checkpoint folder's `config.json` (Hugging Face layout) and a GGUF file's metadata are both
translated into this one dataclass; the forward pass reads nothing else.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from specfleet.errors import UnsupportedModelError

# HF `model_type` -> our architecture name. Qwen2 carries q/k/v biases and (for larger models) an
# untied head; Llama/SmolLM2 has no biases and usually a tied head; Qwen3 adds RMSNorm on q and k.
SUPPORTED_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture model_type={model_type!r}; specfleet supports "
                f"{sorted(SUPPORTED_ARCHS)}"
            )
        # transformers 4 writes rope scaling under rope_scaling, transformers 5 under rope_parameters
        for key in ("rope_scaling", "rope_parameters"):
            rope = cfg.get(key) or {}
            if rope.get("rope_type", rope.get("type")) not in (None, "default"):
                raise UnsupportedModelError(f"unsupported {key} {rope!r}: only plain rotary embeddings are implemented")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        arch = SUPPORTED_ARCHS[model_type]
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self) -> dict:
        """A config.json that transformers understands (used for cached conversions and tests)."""
        model_type = self.arch
        d = {
            "model_type": model_type,
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "qwen3": "Qwen3ForCausalLM"}[model_type]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.arch == "llama":
            d["attention_bias"] = self.attention_bias
        return d

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        try:
            cfg = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from e
        return cls.from_hf_dict(cfg)

    def as_dict(self) -> dict:
        return asdict(self)
