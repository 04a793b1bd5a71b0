"""The single entry point for weights: an HF checkpoint folder or a GGUF file -> a Checkpoint.

A GGUF file is dequantized once (about a minute for a 1.5B model on 2 cores) into an HF-layout
folder under `$SPECFLEET_CACHE/converted/`; every later load reads that folder's safetensors in
seconds. The folder is complete before it becomes visible (written to a temp folder, then renamed),
so an interrupted conversion is redone rather than half-read.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from specfleet.errors import ModelLoadError, UnsupportedModelError
from specfleet.registry import cache_root
from specfleet.runtime.loading import gguf as gguf_loader
from specfleet.runtime.model.config import ModelConfig

logger = logging.getLogger(__name__)

# Bump when the conversion output changes, so stale cache folders are not reused.
CONVERSION_VERSION = 1
_MARKER = "specfleet-conversion.json"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names; no "lm_head.weight" when embeddings are tied
    tokenizer_dir: Path  # loads offline with AutoTokenizer.from_pretrained(tokenizer_dir)
    folder: Path  # HF layout (config.json + safetensors + tokenizer) that transformers can load too


# GGUF block formats a model can be requantized into at load (`quantization="q4_0"` etc.)
REQUANT_FORMATS = ("q4_0", "q8_0", "q4_k")


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, quantization: str = "none") -> Checkpoint:
    """Load an HF checkpoint folder or a `.gguf` file.

    quantization="none": every weight cast to `dtype` (a GGUF file goes through the dense cache).
    quantization="gguf": a GGUF file's matrices stay in their block formats (QTensors over the file's
    memory map, see `gguf_loader.read_gguf_native`); vectors come back in float32 and `dtype` is unused.
    quantization in REQUANT_FORMATS: every matrix quantized into that format at load (vectors float32).
    """
    if quantization != "none":
        return _load_quantized(Path(path).expanduser(), quantization)
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype} is not supported; use one of {[str(d) for d in _DTYPES]}")
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{path} does not exist; pass a Hugging Face checkpoint folder, a .gguf file, "
            "or a registered model name (see `specfleet models list`)"
        )
    if path.is_dir():
        folder = path
    elif is_gguf_file(path):
        folder = converted_folder(path, dtype)
    else:
        raise ModelLoadError(f"{path} is neither a checkpoint folder nor a GGUF file")
    return _load_folder(folder, dtype)


def _load_quantized(path: Path, quantization: str) -> Checkpoint:
    from gguf import GGMLQuantizationType

    if quantization != "gguf" and quantization not in REQUANT_FORMATS:
        raise ModelLoadError(f"unknown quantization {quantization!r} for loading; use none, gguf or one of "
                             f"{list(REQUANT_FORMATS)}")
    if not path.exists():
        raise ModelLoadError(f"{path} does not exist; pass a checkpoint folder, a .gguf file or a registered name")
    requant = None if quantization == "gguf" else GGMLQuantizationType[quantization.upper()]
    if path.is_dir():
        if requant is None:
            raise ModelLoadError(f"quantization='gguf' keeps a GGUF file's formats, but {path} is a checkpoint "
                                 "folder; use none, int8 or one of " + ", ".join(REQUANT_FORMATS))
        ckpt = _load_folder(path, torch.float32)
        ckpt.weights = {n: gguf_loader.requantize(w, requant) if w.ndim == 2 else w for n, w in ckpt.weights.items()}
        return ckpt
    if not is_gguf_file(path):
        raise ModelLoadError(f"{path} is neither a checkpoint folder nor a GGUF file")
    if requant is None:
        config, weights = gguf_loader.read_gguf_native(path.resolve())
    else:
        config, weights = _requantized(path.resolve(), requant)
    check_weights(config, weights, path)
    return Checkpoint(config=config, weights=weights, tokenizer_dir=tokenizer_folder(path), folder=path)


# Bump when requantization's output changes (gguf-py's quantizers, runtime/formats/qtensor.py's Q4_K).
REQUANT_VERSION = 1
_REQUANT_FILE = "weights.safetensors"


def _requantized(source: Path, requant) -> tuple[ModelConfig, dict]:
    """`read_gguf_native(source, requant)`, kept after the first time under `$SPECFLEET_CACHE/requantized/`: the
    matrices in the file's (ggml's) block order, the vectors in float32. Requantizing dequantizes every matrix and
    quantizes it again with gguf-py's numpy code: 7 s for the 0.5B into Q4_0 on an Emerald Rapids Xeon, paid by
    every process that drafts with `qwen-0.5b[quant=q4_0]` (the CPU default fleet's model member); read back, the
    same bytes take well under a second. The metadata (and so the config) still comes from the GGUF file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from specfleet.runtime.formats.qtensor import QTensor

    identity = {**_identity(source), "requant": requant.name, "requant_version": REQUANT_VERSION}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    final = cache_root() / "requantized" / f"{source.stem}-{requant.name.lower()}-{key}"
    if _is_complete(final, identity):
        config = gguf_loader.config_from_metadata(gguf_loader.open_gguf(source), source)
        weights: dict = {}
        try:
            with safe_open(str(final / _REQUANT_FILE), framework="pt") as f:
                layout = json.loads(f.metadata()["qtensors"])
                for name in f.keys():
                    t = f.get_tensor(name)
                    weights[name] = QTensor(t, layout[name][0], tuple(layout[name][1:])) if name in layout else t
            return config, weights
        except Exception as e:  # noqa: BLE001 - a damaged cache entry is redone, never trusted
            logger.warning("the requantized weights cached in %s are unreadable (%s: %s); requantizing again",
                           final, type(e).__name__, e)
            _remove(final)
    config, weights = gguf_loader.read_gguf_native(source, requant)

    def fill(tmp: Path) -> None:
        tensors, layout = {}, {}
        for name, w in weights.items():
            if isinstance(w, QTensor):
                tensors[name] = torch.from_numpy(w.gguf_bytes())
                layout[name] = [int(w.qtype), *w.shape]
            else:
                tensors[name] = w.contiguous()
        save_file(tensors, str(tmp / _REQUANT_FILE), metadata={"qtensors": json.dumps(layout)})

    try:
        _publish(final, identity, fill)
    except OSError as e:  # a read-only or full cache costs the next load the requantization again, nothing more
        logger.warning("could not keep the requantized weights of %s in %s: %s", source, final, e)
    return config, weights


def tokenizer_folder(gguf_path: Path) -> Path:
    """A cache folder holding only the tokenizer built from `gguf_path`'s metadata (a native load needs
    no converted weights); built once, keyed like `converted_folder`."""
    source = gguf_path.resolve()
    identity = _identity(source)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    final = cache_root() / "tokenizers" / f"{source.stem}-{key}"
    if _is_complete(final, identity):
        return final
    return _publish(final, identity, lambda tmp: gguf_loader.save_tokenizer(source, tmp))


def _identity(source: Path) -> dict:
    st = source.stat()
    return {"source": str(source), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "version": CONVERSION_VERSION}


def is_gguf_file(path: Path) -> bool:
    """A file named .gguf or starting with GGUF's magic (False for folders)."""
    path = Path(path)
    if path.is_dir():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise ModelLoadError(f"{path} cannot be read: {e}") from e


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the forward pass reads, with its shape; the contract between loader and model."""
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q_rows, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_rows, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_rows, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_rows),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_rows,),
                p + "self_attn.k_proj.bias": (kv_rows,),
                p + "self_attn.v_proj.bias": (kv_rows,),
            }
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
        if c.is_gemma3:  # norms before and after the MLP (post_attention_layernorm is the attention output's)
            shapes |= {p + "pre_feedforward_layernorm.weight": (c.hidden_size,),
                       p + "post_feedforward_layernorm.weight": (c.hidden_size,)}
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: Path) -> None:
    """Raise a ModelLoadError naming `source` unless `weights` is exactly what `config` implies."""
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise ModelLoadError(
            f"{source}: {len(missing)} tensor(s) missing, e.g. {missing[:4]}; the file is incomplete "
            "or its config does not match its weights"
        )
    extra = sorted(n for n in weights if n not in shapes)
    if extra:
        raise UnsupportedModelError(
            f"{source}: {len(extra)} tensor(s) that a {config.arch} model does not use, e.g. {extra[:4]}"
        )
    wrong = [f"{n} {tuple(weights[n].shape)} != {s}" for n, s in shapes.items() if tuple(weights[n].shape) != s]
    if wrong:
        raise ModelLoadError(f"{source}: tensor shapes do not match the config: {wrong[:4]}")
    check_finite(weights, source)


def check_finite(weights: dict[str, torch.Tensor], source: Path, chunk: int = 1 << 24) -> None:
    """Raise a ModelLoadError naming the tensor if a weight holds NaN or an infinity (a damaged file: the
    model would load and answer NaN or garbage with no word). Checked a chunk at a time (bounded memory)."""
    for name, w in weights.items():
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            continue
        flat = w.reshape(-1)
        for i in range(0, flat.numel(), chunk):
            if not bool(torch.isfinite(flat[i:i + chunk]).all()):
                raise ModelLoadError(f"{source}: tensor {name!r} holds NaN or infinite values; the file is damaged")


def _load_folder(folder: Path, dtype: torch.dtype) -> Checkpoint:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{folder} has no config.json; expected a Hugging Face checkpoint folder "
            "(config.json, *.safetensors, tokenizer files) or a .gguf file"
        )
    try:
        config = ModelConfig.from_json_file(config_path)
    except ModelLoadError as e:  # UnsupportedModelError included: keep the class, name the file
        message = str(e) if str(config_path) in str(e) else f"{config_path}: {e}"
        raise type(e)(message) from e
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_path} is missing or has a bad field: {e!r}") from e
    weights = _read_safetensors(folder, dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some checkpoints store the tied copy as well
    for name in [n for n in weights if n.endswith("rotary_emb.inv_freq")]:
        del weights[name]  # old checkpoints saved this buffer; it is recomputed from rope_theta
    check_weights(config, weights, folder)
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"{folder} has no tokenizer files (one of {list(_TOKENIZER_FILES)})")
    return Checkpoint(config=config, weights=weights, tokenizer_dir=folder, folder=folder)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e!r}") from e
        files = [folder / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index} lists shard(s) that do not exist: {absent}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors files (other weight formats are not supported)")
    return files


def _read_safetensors(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        try:
            part = load_file(str(file))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad files
            raise ModelLoadError(f"{file} is not a readable safetensors file: {type(e).__name__}: {e}") from e
        weights |= {n: t if t.dtype == dtype else t.to(dtype) for n, t in part.items()}
    return weights


def converted_folder(gguf_path: Path, dtype: torch.dtype) -> Path:
    """The cache folder holding `gguf_path` converted to HF layout in `dtype`, converting if needed.

    The folder name hashes the source's path, size and mtime, so a replaced file gets a new
    conversion; the marker inside repeats them and is written last, so its presence proves the
    folder is complete.
    """
    source = gguf_path.resolve()
    identity = _identity(source)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    final = cache_root() / "converted" / f"{source.stem}-{key}-{str(dtype).removeprefix('torch.')}"
    if _is_complete(final, identity):
        return final

    def convert(tmp: Path) -> None:
        logger.info("converting %s to %s (one time; later loads read the cache)", source, final)
        config, weights = gguf_loader.read_gguf(source, dtype)
        check_weights(config, weights, source)
        _write_hf_folder(tmp, config, weights, dtype)
        gguf_loader.save_tokenizer(source, tmp)

    return _publish(final, identity, convert)


def _publish(final: Path, identity: dict, fill) -> Path:
    """Fill a temp folder with `fill(tmp)`, mark it complete and rename it to `final`."""
    if final.exists():  # no valid marker: someone tampered with it; never reuse it
        _remove(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        fill(tmp)
        (tmp / _MARKER).write_text(json.dumps(identity, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final, identity):  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_hf_folder(folder: Path, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    hf_config = config.to_hf_dict() | {"dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file({n: t.contiguous() for n, t in weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


def _is_complete(folder: Path, identity: dict) -> bool:
    try:
        return json.loads((folder / _MARKER).read_text()) == identity
    except (OSError, ValueError):
        return False


def _remove(folder: Path) -> None:
    """Delete a folder without ever leaving a half-deleted one under the name being reused."""
    aside = folder.with_name(f".stale-{folder.name}-{uuid.uuid4().hex[:8]}")
    os.rename(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)
