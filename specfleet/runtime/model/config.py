"""Architecture description of a decoder-only transformer, independent of where weights come from.

A checkpoint folder's `config.json` (Hugging Face layout) and a GGUF file's metadata are both
translated into this one dataclass; the forward pass reads nothing else.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from specfleet.errors import ModelLoadError, UnsupportedModelError

# HF `model_type` -> our architecture name. Qwen2 carries q/k/v biases and (for larger models) an
# untied head; Llama/SmolLM2 has no biases and usually a tied head; Qwen3 adds RMSNorm on q and k.
# Gemma-3 (the text model, `Gemma3ForCausalLM`) differs more: see the Gemma-3 fields below.
SUPPORTED_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "gemma3_text": "gemma3"}
# attention kinds of a layer (the values of HF's `layer_types`)
SLIDING, FULL = "sliding_attention", "full_attention"
# config.json's names of the fields whose names differ here, for error messages
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}
# Gemma-3's defaults where a config leaves a field out (transformers' Gemma3TextConfig, llama.cpp's gemma3)
_GEMMA3_DEFAULTS = {"global_theta": 1_000_000.0, "local_theta": 10_000.0, "sliding_window_pattern": 6,
                    "sliding_window": 4096, "query_pre_attn_scalar": 256, "head_dim": 256}


# The range of every size a config.json gives, as the GGUF loader bounds the same numbers in a GGUF file's
# metadata (gguf_loader._INT_RANGES): unchecked, num_hidden_layers=10**6 spends hours and all memory building
# layers before anything fails. Generous: the largest open models lie well inside.
HF_INT_RANGES = {
    "vocab_size": ("vocab_size", 1, 1 << 24),
    "hidden_size": ("hidden_size", 1, 1 << 17),
    "intermediate_size": ("intermediate_size", 1, 1 << 20),
    "num_layers": ("num_hidden_layers", 1, 1024),
    "num_heads": ("num_attention_heads", 1, 1024),
    "num_kv_heads": ("num_key_value_heads", 1, 1024),
    "head_dim": ("head_dim", 2, 1 << 14),
    "max_position_embeddings": ("max_position_embeddings", 1, 1 << 26),
}


def _check_bounds(fields: dict) -> None:
    for key, (name, lo, hi) in HF_INT_RANGES.items():
        value = fields.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ModelLoadError(f"config.json {name}={value!r} is out of range: expected an integer in "
                                 f"[{lo}, {hi:,}]; the config is corrupt or was edited by hand")


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
    # Gemma-3 (arch "gemma3"; the defaults describe a Llama/Qwen model). The arch itself implies the rest
    # of Gemma's layout: embeddings scaled by sqrt(hidden_size), RMSNorm scaling by (1 + weight), a norm
    # after attention and after the MLP as well as before each, q/k RMSNorm, a tied head.
    hidden_act: str = "silu"  # the MLP's gate activation: silu, or gelu_pytorch_tanh (GELU, tanh approximation)
    query_pre_attn_scalar: float | None = None  # attention scale = query_pre_attn_scalar ** -0.5; None: head_dim
    sliding_window: int | None = None  # keys a query of a SLIDING layer sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; () = every layer FULL
    rope_local_theta: float | None = None  # rotary base of the SLIDING layers; None = rope_theta
    rope_scaling_factor: float = 1.0  # linear position scaling of the FULL layers' rotary (positions / factor)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelLoadError(f"{_HF_NAMES.get(name, name)}={value!r} must be a positive integer (a corrupt "
                                     "or hand-edited config)")
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        # a config read back from JSON (distill's StudentSpec, a remote draft) brings lists
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"activation {self.hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")
        unknown = set(self.layer_types) - {SLIDING, FULL}
        if unknown:
            raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported ({SLIDING}, {FULL})")
        if self.layer_types and len(self.layer_types) < self.num_layers:
            raise UnsupportedModelError(f"layer_types names {len(self.layer_types)} layers, the model has "
                                        f"{self.num_layers}")
        if SLIDING in self.layer_types[:self.num_layers] and not (self.sliding_window and self.sliding_window > 0):
            raise UnsupportedModelError(f"sliding-window layers need a positive sliding_window, "
                                        f"got {self.sliding_window!r}")
        if not self.rope_scaling_factor > 0:
            raise UnsupportedModelError(f"rope scaling factor {self.rope_scaling_factor} must be positive")

    # -- the Gemma-3 layout (runtime/model/decoder.py reads these) ------------------------------------------
    @property
    def is_gemma3(self) -> bool:
        return self.arch == "gemma3"

    @property
    def embed_scale(self) -> float | None:
        """Factor on the embeddings (Gemma: sqrt(hidden_size)); None for none."""
        return self.hidden_size ** 0.5 if self.is_gemma3 else None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None when it attends to the whole context."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type == "gemma3" and "text_config" in cfg:
            raise UnsupportedModelError(
                "a multimodal Gemma-3 checkpoint (model_type 'gemma3', Gemma3ForConditionalGeneration) is not "
                "supported; specfleet runs the text model (model_type 'gemma3_text', Gemma3ForCausalLM) or a "
                "Gemma-3 GGUF file")
        if model_type not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture model_type={model_type!r}; specfleet supports "
                f"{sorted(SUPPORTED_ARCHS)}"
            )
        gemma = _gemma3_fields(cfg) if SUPPORTED_ARCHS[model_type] == "gemma3" else {}
        # transformers 4 writes rope scaling under rope_scaling, transformers 5 under rope_parameters
        for key in ("rope_scaling", "rope_parameters"):
            rope = cfg.get(key) or {}
            if not gemma and rope.get("rope_type", rope.get("type")) not in (None, "default"):
                raise UnsupportedModelError(f"unsupported {key} {rope!r}: only plain rotary embeddings are implemented")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        if not isinstance(num_heads, int) or num_heads < 1:  # before hidden // num_heads below
            raise ModelLoadError(f"num_attention_heads={num_heads!r} must be a positive integer")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        arch = SUPPORTED_ARCHS[model_type]
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        fields = dict(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if cfg.get("num_key_value_heads") is None else cfg["num_key_value_heads"],
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
        _check_bounds(fields | gemma)
        return cls(**(fields | gemma))

    def to_hf_dict(self) -> dict:
        """A config.json that transformers understands (used for cached conversions and tests)."""
        if self.is_gemma3:
            return self._gemma3_hf_dict()
        model_type = self.arch
        d = {
            "model_type": model_type,
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "qwen3": "Qwen3ForCausalLM"}[model_type]],
            **self._shared_hf_fields(),
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
        }
        if self.arch == "llama":
            d["attention_bias"] = self.attention_bias
        return d

    def _shared_hf_fields(self) -> dict:
        """The config.json fields every architecture writes the same way."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }

    def _gemma3_hf_dict(self) -> dict:
        """Gemma3TextConfig's fields: transformers 5 reads rope_parameters, transformers 4 the flat keys."""
        full = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling_factor != 1.0:
            full = {"rope_type": "linear", "factor": self.rope_scaling_factor, "rope_theta": self.rope_theta}
        local_theta = self.rope_local_theta if self.rope_local_theta is not None else self.rope_theta
        d = {
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            **self._shared_hf_fields(),
            "attention_bias": self.attention_bias,
            "hidden_activation": self.hidden_act,
            "query_pre_attn_scalar": _int_if_whole(self.query_pre_attn_scalar or self.head_dim),  # an int there
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types[:self.num_layers]) or [FULL] * self.num_layers,
            "rope_parameters": {"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": local_theta}},
            "rope_theta": self.rope_theta,
            "rope_local_base_freq": local_theta,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        }
        if self.rope_scaling_factor != 1.0:
            d["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_scaling_factor}
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


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _gemma3_fields(cfg: dict) -> dict:
    """The Gemma-3 fields of a Gemma3TextConfig dict (transformers 4 or 5 layout), or an
    UnsupportedModelError for a feature this runtime does not implement."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UnsupportedModelError(f"Gemma-3 with {key}={cfg[key]} is not supported (tanh soft-capping is "
                                        "not implemented)")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma-3 with use_bidirectional_attention is not supported (causal models only)")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"Gemma-3 with activation {act!r} is not supported (gelu_pytorch_tanh)")
    num_layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if not layer_types:  # transformers 4 / older configs: every `pattern`-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or _GEMMA3_DEFAULTS["sliding_window_pattern"])
        layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    rope = cfg.get("rope_parameters") or {}
    if FULL in rope or SLIDING in rope:  # transformers 5: one rotary per layer type
        full, local = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
    else:  # transformers 4: rope_theta and rope_scaling for the global layers, rope_local_base_freq
        full = dict(cfg.get("rope_scaling") or {})
        full["rope_theta"] = cfg.get("rope_theta", rope.get("rope_theta", _GEMMA3_DEFAULTS["global_theta"]))
        local = {"rope_theta": cfg.get("rope_local_base_freq", _GEMMA3_DEFAULTS["local_theta"])}
    full_type = full.get("rope_type", full.get("type")) or "default"
    if full_type not in ("default", "linear"):
        raise UnsupportedModelError(f"Gemma-3 global-layer rope scaling {full!r} is not supported (default, linear)")
    if (local.get("rope_type", local.get("type")) or "default") != "default":
        raise UnsupportedModelError(f"Gemma-3 sliding-layer rope scaling {local!r} is not supported")
    return dict(
        hidden_act=act,
        head_dim=cfg.get("head_dim") or _GEMMA3_DEFAULTS["head_dim"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=True,
        attention_bias=bool(cfg.get("attention_bias", False)),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or _GEMMA3_DEFAULTS["query_pre_attn_scalar"]),
        sliding_window=cfg.get("sliding_window", _GEMMA3_DEFAULTS["sliding_window"]),
        layer_types=tuple(layer_types),
        rope_theta=float(full.get("rope_theta", _GEMMA3_DEFAULTS["global_theta"])),
        rope_local_theta=float(local.get("rope_theta", _GEMMA3_DEFAULTS["local_theta"])),
        rope_scaling_factor=float(full.get("factor", 1.0)) if full_type == "linear" else 1.0,
    )
