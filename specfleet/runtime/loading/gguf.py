"""Reading a llama.cpp GGUF file into Hugging Face-named dense tensors, a ModelConfig and a tokenizer.

GGUF is only an input format here: `loader.py` converts a file once into an HF-layout cache folder
and every later load reads that folder. This module knows the GGUF specifics:

- metadata keys (`<arch>.embedding_length`, `tokenizer.ggml.eos_token_id`, ...) -> ModelConfig;
- tensor names (`blk.3.attn_q.weight`) -> HF names (`model.layers.3.self_attn.q_proj.weight`);
- llama.cpp's converter permutes the rows of q_proj/k_proj for the `llama` arch (it rotates
  interleaved pairs, HF rotates halves); we undo that so the HF forward pass applies unchanged.
- `gemma3`: llama.cpp stores every RMSNorm weight with the 1 of Gemma's (1 + weight) already added
  (convert_hf_to_gguf.py's Gemma models shift `*norm.weight` by 1); we subtract it again, so the
  weights are Hugging Face's and the converted folder loads in transformers too. Its `ffn_norm` is
  the MLP's input norm, which HF calls `pre_feedforward_layernorm` (Llama's `post_attention_layernorm`).
  What the file does not say is taken as llama.cpp takes it: every 6th layer global, the others with
  a sliding window and rotary base 10000, attention scaled by head_dim ** -0.5 (the 27B model:
  (hidden / heads) ** -0.5).
"""
from __future__ import annotations

import mmap
import re
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specfleet.errors import ModelLoadError, UnsupportedModelError
from specfleet.runtime.model.config import ModelConfig

if TYPE_CHECKING:
    from specfleet.runtime.loading.gguf_file import GGUFFile as GGUFReader, Tensor as ReaderTensor

# The GGUF archs our forward pass implements: the HF llama/qwen2/qwen3 layout, and Gemma-3's text model.
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# Archs whose q/k rows llama.cpp permuted on conversion (convert_hf_to_gguf.py, LlamaModel.permute).
_PERMUTED_ARCHS = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma-3's four norms per layer (llama.cpp's names -> HF's Gemma3DecoderLayer names)
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_NAMES_BY_ARCH = {"gemma3": _GEMMA3_LAYER_NAMES}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# archs whose norm weights llama.cpp stored as 1 + weight
_NORM_SHIFTED_ARCHS = ("gemma3",)
_DENSE_TYPES = ("F32", "F16", "BF16")


def open_gguf(path: Path) -> GGUFReader:
    """The header of the GGUF file at `path` (gguf_file.GGUFFile: its metadata, its tensors memory-mapped),
    or a ModelLoadError that says the file is damaged.

    The reader raises ValueError (struct.error, OSError) on garbage; we also check that every tensor's bytes
    lie inside the file, start at the file's alignment and overlap no other tensor.
    """
    from specfleet.runtime.loading.gguf_file import GGUFFile

    try:
        reader = GGUFFile(path)
    except Exception as e:  # noqa: BLE001 - any parse failure means the same thing to the user
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (corrupt, truncated or not GGUF): "
            f"{type(e).__name__}: {e}"
        ) from e
    file_size = path.stat().st_size
    alignment = int(getattr(reader, "alignment", 32) or 32)
    spans = []
    for t in reader.tensors:
        start = int(t.data_offset)
        end = start + int(t.n_bytes)
        if end > file_size or t.data.nbytes != int(t.n_bytes):
            raise ModelLoadError(
                f"{path} is truncated: tensor {t.name!r} ends at byte {end:,} but the file has "
                f"{file_size:,} bytes; re-download or re-assemble it"
            )
        # GGUF places every tensor at a multiple of general.alignment; one that is not was written wrong
        # (its blocks would be read from the wrong bytes: garbage output, no error)
        if start % alignment:
            raise ModelLoadError(f"{path}: tensor {t.name!r} starts at byte {start:,}, which is not a multiple of "
                                 f"the file's alignment ({alignment}); the file is corrupt")
        spans.append((start, end, t.name))
    spans.sort()
    for (_, end0, name0), (start1, _, name1) in zip(spans, spans[1:]):
        if start1 < end0:
            raise ModelLoadError(f"{path}: tensors {name0!r} and {name1!r} overlap (from byte {start1:,}); the file "
                                 f"is corrupt")
    return reader


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _uniform(value: Any, key: str, path: Path) -> Any:
    """Some archs store a per-layer list for head counts; ours need one value for all layers."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"{path}: per-layer {key}={value} is not supported")
        return value[0]
    return value


# The range of every number the loader reads from the metadata. A value outside is a corrupt or hand-edited
# file, refused here with the field's name: unchecked, head_count=0 ends in a ZeroDivisionError,
# head_count_kv=0 silently means "as many as head_count", block_count=0 builds a model without layers
# and block_count=2**31 loops for hours over layers that do not exist. The bounds are generous: the largest
# open models (hidden 16k-25k, 126 layers, 128 heads, contexts of 1M-10M) lie well inside.
_INT_RANGES = {
    "embedding_length": (1, 1 << 17),
    "feed_forward_length": (1, 1 << 20),
    "block_count": (1, 1024),
    "attention.head_count": (1, 1024),
    "attention.head_count_kv": (1, 1024),
    "attention.key_length": (2, 1 << 14),
    "context_length": (1, 1 << 26),
    "attention.sliding_window": (1, 1 << 26),
    "attention.sliding_window_pattern": (0, 1024),
    "vocab_size": (1, 1 << 24),
}
# (low, high) open at low: epsilons, rotary bases and scale factors are positive and finite.
_FLOAT_RANGES = {
    "attention.layer_norm_rms_epsilon": (0.0, 1.0),
    "rope.freq_base": (0.0, 1e12),
    "rope.freq_base_swa": (0.0, 1e12),
    "rope.scaling.factor": (0.0, 1e6),
}


def _checked_int(value: Any, key: str, path: Path, name: str) -> int:
    """`value` as an int inside `_INT_RANGES[key]`, or a ModelLoadError naming the field (`name`)."""
    lo, hi = _INT_RANGES[key]
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and lo <= int(value) <= hi:
        return int(value)
    raise ModelLoadError(f"{path}: GGUF {name}={value!r} is out of range: expected an integer in "
                         f"[{lo}, {hi:,}]; the file is corrupt or was edited by hand")


def _checked_float(value: Any, key: str, path: Path, name: str) -> float:
    """`value` as a float in `_FLOAT_RANGES[key]` (low end excluded; NaN and infinity fail), or a
    ModelLoadError naming the field (`name`)."""
    lo, hi = _FLOAT_RANGES[key]
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and lo < float(value) <= hi:
        return float(value)
    raise ModelLoadError(f"{path}: GGUF {name}={value!r} is out of range: expected a number in "
                         f"({lo}, {hi:g}]; the file is corrupt or was edited by hand")


def _token_id(reader: GGUFReader, key: str, vocab: int, path: Path) -> int | None:
    """A special token id from the metadata, which must name a row of the embedding if present."""
    value = _field(reader, f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= int(value) < vocab:
        return int(value)
    raise ModelLoadError(f"{path}: GGUF metadata tokenizer.ggml.{key}={value!r} is not a token id of the "
                         f"{vocab}-token vocabulary")


# Control tokens that end a generation whatever the file names as its EOS: Qwen2.5's files name <|im_end|>
# only, but a raw completion ends with <|endoftext|> (its generation_config lists both, and llama.cpp treats
# both as end of generation), so without it a completion would run on past the end of its text.
END_OF_TEXT = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")


def _end_of_text_controls(reader: GGUFReader) -> list[int]:
    """Ids of the control tokens (GGUF token type 3) whose text is one of END_OF_TEXT."""
    types, tokens = reader.fields.get("tokenizer.ggml.token_type"), reader.fields.get("tokenizer.ggml.tokens")
    if types is None or tokens is None:
        return []
    kinds, texts = np.asarray(types.value), tokens.value
    if kinds.ndim != 1 or not isinstance(texts, Sequence):
        return []
    out = []
    for i in np.nonzero(kinds == 3)[0]:
        if i < len(texts) and texts[i] in END_OF_TEXT:
            out.append(int(i))
    return out


def config_from_metadata(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; specfleet supports {list(GGUF_ARCHS)}"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and not (arch == "gemma3" and scaling == "linear"):
        raise UnsupportedModelError(f"{path}: rope scaling {scaling!r} is not supported")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks '{arch}.{key}'")
        return value

    def integer(key: str, default: int | None = None, per_layer: bool = False) -> int:
        value = need(key) if default is None else _field(reader, f"{arch}.{key}", default)
        return _checked_int(_uniform(value, key, path) if per_layer else value, key, path, f"{arch}.{key}")

    def number(key: str, default: float | None = None) -> float:
        value = need(key) if default is None else _field(reader, f"{arch}.{key}", default)
        return _checked_float(value, key, path, f"{arch}.{key}")

    tensor_names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(f"{path}: missing tensor 'token_embd.weight'")
    # The embedding's row count is authoritative: `<arch>.vocab_size` is optional metadata.
    vocab = _checked_int(int(embd.shape[-1]), "vocab_size", path, "token_embd.weight rows (the vocabulary)")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    num_tokens = len(tokens.value) if tokens is not None and isinstance(tokens.value, Sequence) else 0
    if num_tokens > vocab:  # the tokenizer could give ids that index past the embedding
        raise ModelLoadError(f"{path}: the tokenizer has {num_tokens:,} tokens but token_embd.weight has only "
                             f"{vocab:,} rows; the file is corrupt")
    hidden = integer("embedding_length")
    num_heads = integer("attention.head_count", per_layer=True)
    num_kv_heads = integer("attention.head_count_kv", num_heads, per_layer=True)
    if num_kv_heads > num_heads:
        raise ModelLoadError(f"{path}: GGUF {arch}.attention.head_count_kv={num_kv_heads} exceeds "
                             f"{arch}.attention.head_count={num_heads}")
    if _field(reader, f"{arch}.attention.key_length") is not None:
        head_dim = integer("attention.key_length")
    else:
        head_dim = hidden // num_heads
    if head_dim < 2 or head_dim % 2:  # rotary embeddings turn pairs of dimensions
        raise ModelLoadError(f"{path}: the head size {head_dim} (GGUF {arch}.attention.key_length, or "
                             f"embedding_length / head_count) must be even and positive")
    # Chat models stop on end-of-turn as well as end-of-text; llama.cpp stores the former as EOT/EOM.
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = _token_id(reader, key, vocab, path)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    eos_ids += [t for t in _end_of_text_controls(reader) if t not in eos_ids and t < vocab]
    hf = {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": integer("feed_forward_length", per_layer=True),
        "num_hidden_layers": integer("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon"),
        # llama.cpp's own default when a file omits the base frequency.
        "rope_theta": number("rope.freq_base", 10000.0),
        "max_position_embeddings": integer("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _token_id(reader, "bos_token_id", vocab, path),
        "eos_token_id": eos_ids,
    }
    if arch == "gemma3":
        hf |= _gemma3_metadata(reader, path, hf, integer, number)
    try:
        return ModelConfig.from_hf_dict(hf)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e}") from e


def _gemma3_metadata(reader: GGUFReader, path: Path, hf: dict, integer, number) -> dict:
    """Gemma3TextConfig fields from a gemma3 GGUF (see the module doc for the values it leaves out);
    `integer` and `number` read a range-checked field (config_from_metadata's)."""
    arch = "gemma3"
    num_layers = hf["num_hidden_layers"]
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: true = sliding window
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{path}: sliding_window_pattern names {len(pattern)} layers, the model has "
                                 f"{num_layers}")
        sliding = [bool(x) for x in pattern]
    else:  # every `pattern`-th layer global (llama.cpp's set_swa_pattern; 0: every layer sliding)
        pattern = integer("attention.sliding_window_pattern", 6)
        sliding = [pattern == 0 or (i + 1) % pattern != 0 for i in range(num_layers)]
    extra = {
        "model_type": "gemma3_text",
        "sliding_window": integer("attention.sliding_window"),
        "layer_types": ["sliding_attention" if x else "full_attention" for x in sliding],
        "rope_local_base_freq": number("rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": (hf["hidden_size"] // hf["num_attention_heads"] if num_layers == 62
                                  else hf["head_dim"]),
        "hidden_activation": "gelu_pytorch_tanh",
        # soft-capping (Gemma-2's) is not implemented: a file that sets it is refused by ModelConfig
        "attn_logit_softcapping": _field(reader, f"{arch}.attn_logit_softcapping") or None,
        "final_logit_softcapping": _field(reader, f"{arch}.final_logit_softcapping") or None,
    }
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        extra["rope_scaling"] = {"rope_type": "linear", "factor": number("rope.scaling.factor")}
    return extra


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """HF parameter name for a GGUF tensor name of `arch`, or None if the name is not one we know."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight"
    m = _LAYER_RE.match(gguf_name)
    names = _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` on q/k rows (weights [rows, in] or biases [rows]).

    llama.cpp orders each head's rows as interleaved pairs (x0,x1),(x2,x3)...; HF orders them as
    halves [x0,x2,...|x1,x3,...]. With head_dim 4, GGUF rows [a0,b0,a1,b1] become HF [a0,a1,b0,b1]:
    view each head as [head_dim/2, 2] and transpose to [2, head_dim/2].
    """
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _dequantize(tensor: ReaderTensor, path: Path) -> np.ndarray:
    from gguf import dequantize

    try:
        # quantized types come back as [rows, cols] float32; F32/F16/BF16 keep their numpy shape.
        w = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise UnsupportedModelError(
            f"{path}: tensor {tensor.name!r} uses {tensor.tensor_type.name}, which gguf cannot dequantize"
        ) from e
    expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF dims are innermost-first
    return w.reshape(expected)


def _tensors(reader: GGUFReader, config: ModelConfig, path: Path, desc: str, delay: float):
    """(tensor, HF name, heads whose q/k rows llama.cpp permuted or None, offset to add to the values) for
    every tensor, with a progress bar over them (shown once `delay` seconds have passed)."""
    from tqdm import tqdm

    for tensor in tqdm(reader.tensors, desc=desc, unit="tensor", delay=delay, leave=False):
        name = hf_name(tensor.name, config.arch)
        if name is None:
            raise UnsupportedModelError(
                f"{path}: tensor {tensor.name!r} has no counterpart in specfleet's {config.arch} model "
                "(e.g. rope_freqs means rope scaling, which is not supported)"
            )
        heads = None
        if config.arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_heads
        elif config.arch in _PERMUTED_ARCHS and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_kv_heads
        offset = -1.0 if config.arch in _NORM_SHIFTED_ARCHS and name.endswith("norm.weight") else 0.0
        yield tensor, name, heads, offset


@contextmanager
def _tensor_errors(tensor: ReaderTensor, path: Path):
    """Turn the ValueError of a tensor whose shape disagrees with the metadata into a load error that names
    it: numpy's reshape when the heads do not divide the q/k rows, QTensor's when blocks do not tile a row."""
    try:
        yield
    except (ValueError, IndexError) as e:
        dims = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} of shape {dims} ({tensor.tensor_type.name}) does not "
                             f"fit the model its metadata describes: {e}") from e


def _dense(tensor: ReaderTensor, path: Path, heads: int | None, offset: float = 0.0) -> torch.Tensor:
    """The tensor dequantized to float32 in HF layout (a writable copy, never a view of the file), plus
    `offset` (llama.cpp's +1 on Gemma's norms taken back)."""
    w = _dequantize(tensor, path)
    if np.issubdtype(w.dtype, np.floating) and not np.isfinite(w).all():
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} holds NaN or infinite values; the file is damaged")
    if heads is not None:
        w = unpermute_qk(w, heads)
    if offset:
        w = w.astype(np.float32) + np.float32(offset)
    if not w.flags.writeable:  # F32 tensors come back as views of the read-only memory map
        w = w.copy()
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def read_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize every tensor of a GGUF file into HF-named tensors of `dtype`.

    Memory peaks at the final weights plus one float32 copy of the largest tensor, because each
    tensor is cast to `dtype` right after it is dequantized. A progress bar runs over the tensors
    (the conversion takes a minute or two for a 1.5B model on 2 cores).
    """
    reader = open_gguf(path)
    config = config_from_metadata(reader, path)
    weights: dict[str, torch.Tensor] = {}
    for tensor, name, heads, offset in _tensors(reader, config, path, f"converting {path.name}", 0.0):
        with _tensor_errors(tensor, path):
            weights[name] = _dense(tensor, path, heads, offset).to(dtype)
    return config, weights


def save_tokenizer(path: Path, out_dir: Path) -> None:
    """Build the tokenizer transformers derives from the GGUF metadata and save it to `out_dir`.

    Saving it means later loads need neither the GGUF nor the slow metadata parse, and the
    folder loads with plain `AutoTokenizer.from_pretrained(out_dir)` offline.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for bad metadata
        raise ModelLoadError(
            f"{path}: cannot build a tokenizer from the GGUF metadata: {type(e).__name__}: {e}"
        ) from e
    if not getattr(tok, "chat_template", None):
        template = _field(open_gguf(path), "tokenizer.chat_template")
        if template:  # keep the template even if a transformers version drops it on the way
            tok.chat_template = template
    tok.save_pretrained(str(out_dir))


def read_gguf_native(path: Path, requant=None) -> tuple[ModelConfig, dict[str, Any]]:
    """HF-named weights with every matrix kept in its GGUF block format (a QTensor, runtime/formats/qtensor.py).

    A matrix's QTensor wraps the reader's memory map of the file without a copy, or for Q4_K / Q6_K
    holds a re-ordered copy (whose mapped pages are then dropped), so resident memory comes to about
    the file's size, and no dense copy ever exists.
    Vectors (norms, biases) and matrices stored as F32/F16/BF16 in a format the kernels do not take
    come back dense in float32. The q/k rows of the `llama` arch are un-permuted by reordering whole
    rows, which GGUF's blocks (along a row) allow. With `requant` (a GGMLQuantizationType) every matrix
    is dequantized and quantized again into that format instead, one at a time (see `requantize`).
    """
    reader = open_gguf(path)
    config = config_from_metadata(reader, path)
    weights: dict[str, Any] = {}
    for tensor, name, heads, offset in _tensors(reader, config, path, f"loading {path.name}", 3.0):
        with _tensor_errors(tensor, path):
            weights[name] = _native(reader, tensor, path, heads, offset, requant)
    return config, weights


def _native(reader: GGUFReader, tensor: ReaderTensor, path: Path, heads: int | None, offset: float, requant):
    """One tensor as `read_gguf_native` keeps it: a QTensor, or dense float32 (see there)."""
    from specfleet.runtime.formats import qtensor

    kind = tensor.tensor_type
    if len(tensor.shape) != 2 or offset or (kind.name in _DENSE_TYPES and kind not in qtensor.SUPPORTED_TYPES):
        return _dense(tensor, path, heads, offset)
    if requant is not None:
        return requantize(_dense(tensor, path, heads), requant)
    if kind not in qtensor.SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in qtensor.SUPPORTED_TYPES))
        raise UnsupportedModelError(
            f"{path}: tensor {tensor.name!r} is stored as {kind.name}, which specfleet cannot run as it is "
            f"(its kernels take {supported}); load the file dequantized instead with quantization='none' "
            "(CLI --quantization none), or requantize it with quantization='q8_0'"
        )
    cols, rows = (int(d) for d in tensor.shape.tolist())
    _check_finite_scales(tensor, path)
    w = qtensor.QTensor(tensor.data, kind, (rows, cols))
    if kind in qtensor.PACKED_TYPES:  # a re-ordered copy: the file's pages are not needed again
        _drop_mapped_pages(reader, tensor)
    if heads is not None:
        w = w.select_rows(torch.from_numpy(unpermute_qk(np.arange(rows), heads)))
    return w


# byte offsets of the fp16 scale fields inside one block of each format the kernels run (ggml's layouts)
_SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def _check_finite_scales(tensor: ReaderTensor, path: Path) -> None:
    """A block format's values are its small integers times fp16 scales: the weights are finite iff every
    scale is. A NaN or infinite scale (a damaged file) is refused here, naming the tensor, rather than
    turning every output into NaN with no word."""
    from specfleet.runtime.formats import qtensor

    offsets = _SCALE_OFFSETS.get(tensor.tensor_type.name)
    if offsets is None:
        return
    size = qtensor.FORMATS[tensor.tensor_type].type_size
    blocks = np.asarray(tensor.data).reshape(-1).view(np.uint8).reshape(-1, size)
    for off in offsets:
        scales = np.ascontiguousarray(blocks[:, off:off + 2]).view(np.float16)
        if not np.isfinite(scales).all():
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) has NaN or infinite "
                                 f"scales; the file is damaged")


def _drop_mapped_pages(reader, tensor) -> None:
    """Unmap the whole pages of `tensor`'s bytes from this process (they stay in the page cache): a
    tensor that was copied would otherwise count twice in resident memory while the map lives."""
    mm = getattr(reader, "mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = -(-int(tensor.data_offset) // page) * page
    end = (int(tensor.data_offset) + int(tensor.n_bytes)) // page * page
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def requantize(weight: torch.Tensor, qtype):
    """A dense [N, K] weight quantized to `qtype`; a K that is not a multiple of the format's block takes
    Q8_0 (32-wide blocks) instead, as llama.cpp does for such rows, or stays dense if even that does not fit."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from specfleet.runtime.formats import qtensor

    k = int(weight.shape[1])
    if k % GGML_QUANT_SIZES[qtype][0]:
        qtype = GGMLQuantizationType.Q8_0
        if k % GGML_QUANT_SIZES[qtype][0]:
            return weight.float()
    return qtensor.quantize(weight.float(), qtype)
