"""load_checkpoint on tiny GGUF files written here, on HF folders, and on damaged inputs.

The GGUF fixtures are written the way llama.cpp's converter writes them (q/k rows permuted for the
`llama` arch, HF names renamed independently of the code under test), so loading them back and
comparing with the original tensors checks the name mapping and the un-permutation.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specfleet.errors import ModelLoadError, UnsupportedModelError
from specfleet.runtime.loading import gguf as gguf_loader
from specfleet.runtime.loading.checkpoint import load_checkpoint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GGUF_LAYER_NAMES = {  # HF suffix -> llama.cpp name, written out independently of gguf_loader
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tiny_vocab() -> tuple[list[str], list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 3 = CONTROL
    return tokens, types


def write_tiny_shape(w, cfg) -> None:
    """The model-shape keys every tiny GGUF writer puts in `w` alike: layers, context, widths, heads."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)


def write_tiny_header(w, cfg, arch: str) -> None:
    """Everything but the tensors that a tiny Llama or Qwen2 GGUF writer puts in `w`: the shape, the norm's
    epsilon, the rotary base (and Llama's key length) and the tokenizer."""
    write_tiny_shape(w, cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "llama":
        w.add_key_length(cfg.head_dim)
    write_tiny_tokenizer(w, cfg)


def write_tiny_tokenizer(w, cfg) -> None:
    """The tiny byte-level BPE vocabulary, its merges, special ids and chat template into GGUF writer `w`."""
    tokens, types = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_chat_template(CHAT_TEMPLATE)


def tiny_hf_model(arch: str):
    """A 2-layer model with every parameter random (HF zero-inits biases, which would hide bugs)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokens, _ = tiny_vocab()
    common = dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=tokens.index("<|endoftext|>"),
                  eos_token_id=tokens.index("<|im_end|>"))
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=16, rope_theta=50000.0, tie_word_embeddings=True))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=False))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.ndim == 1 and "norm" in str(p) else 0))
    return model.eval()


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, reimplemented for the fixture."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.{kind}"


def write_gguf(path: Path, model, arch: str, skip: tuple[str, ...] = (),
               metadata: dict | None = None) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would; return the HF-named float32 tensors a loader must recover.

    One tensor is stored as Q8_0 and one as F16, so the expected values are their round trips.
    `metadata` (full key -> value) overrides what the writer derived from the model: damaged files.
    """
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    write_tiny_header(w, cfg, arch)
    for key, value in (metadata or {}).items():
        kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else (
            gguf.GGUFValueType.UINT32 if value >= 0 else gguf.GGUFValueType.INT32)
        w.add_key_value(key, value, kind)
    expected: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if (name == "lm_head.weight" and cfg.tie_word_embeddings) or gguf_name(name) in skip:
            continue
        x = t.float().numpy()
        if name == "model.layers.1.mlp.down_proj.weight":
            q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            expected[name] = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0))
            data, raw = q, gguf.GGMLQuantizationType.Q8_0
        elif name == "model.layers.0.mlp.up_proj.weight":
            data, raw = x.astype(np.float16), None
            expected[name] = torch.from_numpy(data.astype(np.float32))
        else:
            data, raw = x, None
            expected[name] = torch.from_numpy(x.copy())
        if arch == "llama" and ".q_proj." in name:
            data = llamacpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llamacpp_permute(data, cfg.num_key_value_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(data), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECFLEET_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory):
    arch = request.param
    model = tiny_hf_model(arch)
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    expected = write_gguf(path, model, arch)
    with torch.no_grad():  # the reference model holds exactly the values the file can represent
        model.load_state_dict(expected, strict=False)
    return arch, path, model, expected


def test_gguf_tensors_config_and_tokenizer_round_trip(tiny_gguf, tmp_cache):
    arch, path, model, expected = tiny_gguf
    ckpt = load_checkpoint(path)

    assert set(ckpt.weights) == set(expected)
    for name, tensor in expected.items():
        assert ckpt.weights[name].dtype == torch.float32
        assert torch.equal(ckpt.weights[name], tensor), name
    c = ckpt.config
    assert (c.arch, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (arch, 2, 4, 2, 16)
    assert c.rope_theta == model.config.rope_parameters["rope_theta"]
    assert c.tie_word_embeddings == (arch == "llama") and c.attention_bias == (arch == "qwen2")
    # the file names <|im_end|> as EOS; the control token <|endoftext|> ends a generation too (gguf_loader.END_OF_TEXT)
    end_of_text = tiny_vocab()[0].index("<|endoftext|>")
    assert (c.bos_token_id, c.eos_token_ids) == (model.config.bos_token_id, (model.config.eos_token_id, end_of_text))
    assert ckpt.folder.parent == tmp_cache / "converted" and ckpt.folder.name.endswith("-float32")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt.tokenizer_dir)
    text = "a the cat<|im_end|>"
    ids = tok(text)["input_ids"]
    assert tok.convert_tokens_to_ids("Ġthe") in ids and ids[-1] == c.eos_token_ids[0]
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # The converted folder must mean the same model to transformers (rope, eps, bias, tying).
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt.folder, dtype=torch.float32).eval()
    x = torch.tensor([[5, 80, 17, 200, 3, 99]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, model(x).logits, rtol=0, atol=1e-5)


def test_cached_conversion_is_reused_and_per_dtype(tiny_gguf, tmp_cache, monkeypatch):
    _, path, _, expected = tiny_gguf
    first = load_checkpoint(path)
    monkeypatch.setattr(gguf_loader, "read_gguf", lambda *a: pytest.fail("cache not used"))
    again = load_checkpoint(path)
    assert again.folder == first.folder
    assert all(torch.equal(again.weights[n], t) for n, t in expected.items())
    monkeypatch.undo()
    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_cache))
    half = load_checkpoint(path, torch.bfloat16)
    assert half.folder != first.folder and half.folder.name.endswith("-bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in half.weights.values())
    assert sorted(p.name for p in (tmp_cache / "converted").iterdir()) == sorted([first.folder.name, half.folder.name])


def test_changed_source_is_converted_again(tiny_gguf, tmp_cache):
    _, path, _, _ = tiny_gguf
    first = load_checkpoint(path).folder
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert load_checkpoint(path).folder != first


def test_interrupted_conversion_leaves_no_cache(tiny_gguf, tmp_cache, monkeypatch):
    _, path, _, _ = tiny_gguf

    def crash(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_loader, "save_tokenizer", crash)
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(path)
    assert list((tmp_cache / "converted").iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_cache))
    assert load_checkpoint(path).weights


def test_hf_folder_sharded_and_cast(tiny_gguf, tmp_path):
    arch, path, model, expected = tiny_gguf
    folder = tmp_path / "hf"
    model.save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").exists()
    for f in load_checkpoint(path).folder.glob("tokenizer*"):
        shutil.copy(f, folder)
    ckpt = load_checkpoint(folder, torch.bfloat16)
    assert ckpt.folder == folder and ckpt.tokenizer_dir == folder
    assert set(ckpt.weights) == set(expected)  # a tied lm_head copy is dropped
    assert all(torch.equal(ckpt.weights[n], t.to(torch.bfloat16)) for n, t in expected.items())


def test_unpermute_worked_example():
    # one head, head_dim 4: llama.cpp stores rows [a0, b0, a1, b1]; HF wants [a0, a1, b0, b1]
    hf = np.arange(8, dtype=np.float32).reshape(4, 2)
    gguf_rows = llamacpp_permute(hf, 1)
    assert gguf_rows[:, 0].tolist() == [0, 4, 2, 6]
    np.testing.assert_array_equal(gguf_loader.unpermute_qk(gguf_rows, 1), hf)


# ---- errors: each names the file and says what is wrong ----

def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_checkpoint(tmp_path)


def test_unsupported_arch_in_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*gpt2"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_corrupt_gguf(tiny_gguf, tmp_path, damage):
    _, path, _, _ = tiny_gguf
    bad = tmp_path / "bad.gguf"
    data = path.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if damage == "truncated" else np.random.bytes(4096))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*(truncated|not a readable GGUF)"):
        load_checkpoint(bad)


def test_missing_tensor_in_gguf(tmp_path):
    path = tmp_path / "holey.gguf"
    write_gguf(path, tiny_hf_model("qwen2"), "qwen2", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelLoadError, match=r"holey\.gguf.*missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(path)


@pytest.mark.parametrize("key, value", [
    ("attention.head_count", 0), ("attention.head_count_kv", 0), ("attention.head_count_kv", 8),
    ("block_count", 0), ("block_count", 2**31), ("embedding_length", 0), ("feed_forward_length", 0),
    ("context_length", 0), ("attention.key_length", 15), ("attention.key_length", 0),
    ("attention.layer_norm_rms_epsilon", 0.0), ("rope.freq_base", float("nan")), ("rope.freq_base", -1.0),
    ("block_count", -1),
])
@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_gguf_metadata_out_of_range_names_the_field(tmp_path, key, value, quantization):
    """Each number the loader reads is range-checked: no ZeroDivisionError, no silent default for a zero
    head_count_kv, no zero-layer model, no hour-long loop over 2**31 layers."""
    path = tmp_path / "bad.gguf"
    write_gguf(path, tiny_hf_model("llama"), "llama", metadata={f"llama.{key}": value})
    with pytest.raises(ModelLoadError, match=rf"bad\.gguf.*llama\.{re.escape(key)}"):
        load_checkpoint(path, quantization=quantization)


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("num_key_value_heads", 0),
                                        ("num_hidden_layers", 0), ("hidden_size", -64), ("vocab_size", "97")])
def test_config_json_out_of_range_names_the_field(tiny_gguf, tmp_path, key, value):
    """The same for a checkpoint folder's config.json: num_attention_heads=0 divided by zero and
    num_key_value_heads=0 silently meant 'as many as the heads'."""
    arch, path, _, _ = tiny_gguf
    folder = load_checkpoint(path).folder
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {key: value}))
    with pytest.raises(ModelLoadError, match=rf"bad/config\.json.*{key}"):
        load_checkpoint(bad)


@pytest.mark.parametrize("key", ["bos_token_id", "eos_token_id"])
def test_gguf_special_token_outside_the_vocabulary(tmp_path, key):
    path = tmp_path / "bad.gguf"
    write_gguf(path, tiny_hf_model("qwen2"), "qwen2", metadata={f"tokenizer.ggml.{key}": 10**6})
    with pytest.raises(ModelLoadError, match=rf"bad\.gguf.*tokenizer\.ggml\.{key}"):
        load_checkpoint(path, quantization="gguf")


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_gguf_tensor_that_does_not_fit_the_heads(tmp_path, quantization):
    """6 heads of 16 (valid numbers, but a q_proj of 64 rows): un-permuting the rows cannot split them into
    heads; the error names the tensor instead of surfacing numpy's bare ValueError."""
    path = tmp_path / "bad.gguf"
    write_gguf(path, tiny_hf_model("llama"), "llama", metadata={"llama.attention.head_count": 6})
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*'blk\.0\.attn_q\.weight'.*does not fit"):
        load_checkpoint(path, quantization=quantization)


def test_quantized_gguf_tensor_that_does_not_fit_the_heads(tmp_path):
    """The same through QTensor rows (a Q8_0 q_proj kept in its block format)."""
    from tiny_quant_models import write_quantized_gguf

    path = tmp_path / "bad.gguf"
    model = tiny_hf_model("llama")
    real = gguf.GGUFWriter.add_head_count
    try:  # the writer takes its head count from the model's config; this file claims 6
        gguf.GGUFWriter.add_head_count = lambda self, count: real(self, 6)
        write_quantized_gguf(path, model, "llama")
    finally:
        gguf.GGUFWriter.add_head_count = real
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*'blk\.0\.attn_q\.weight'.*does not fit"):
        load_checkpoint(path, quantization="gguf")


def test_unsupported_arch_in_gguf(tmp_path):
    path = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"gemma\.gguf.*'gemma2'"):
        load_checkpoint(path)


# ---- the real SmolLM2 file: our un-permuted weights against transformers' own GGUF loader ----

@pytest.mark.real_model
def test_real_smollm2_matches_transformers_gguf_loader(monkeypatch):
    from specfleet import registry

    required = os.environ.get("SPECFLEET_REQUIRE_REAL") == "1"
    if not registry.is_installed("smollm2-135m"):
        if required:
            pytest.fail("SmolLM2 is not installed: run `specfleet models install smollm2-135m`")
        pytest.skip("SmolLM2 not installed (specfleet models install smollm2-135m)")
    try:
        import accelerate  # noqa: F401 - transformers needs it to load a GGUF itself
    except ImportError:
        if required:
            pytest.fail("the reference check needs `pip install accelerate`")
        pytest.skip("accelerate not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.undo()  # use the real cache: the conversion is reused between runs
    path = registry.resolve_model("smollm2-135m")
    ckpt = load_checkpoint(path, torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(ckpt.folder, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    tok = AutoTokenizer.from_pretrained(ckpt.tokenizer_dir)
    text = "def add(a, b):\n    return a + b  # 12345, héllo"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    with torch.no_grad():
        x = torch.tensor([ids])
        torch.testing.assert_close(ours(x).logits, theirs(x).logits, rtol=0, atol=1e-4)


# -- issue 44, item 10: damage that used to load and give NaN or garbage with no word -------------------
def _poke_tensor_offset(path: Path, name: str, offset_of) -> None:
    """Rewrite tensor `name`'s data offset (relative to the data section) in place: offset_of(reader, i)."""
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")
    i = next(k for k, t in enumerate(reader.tensors) if t.name == name)
    reader.tensors[i].field.parts[-1][0] = offset_of(reader, i)
    reader.data.flush()
    del reader


def _relative(reader, i: int) -> int:
    return int(reader.tensors[i].data_offset) - int(reader.data_offset)


def test_misaligned_and_overlapping_gguf_tensors_are_refused(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf_model("llama"), "llama")
    bad = tmp_path / "misaligned.gguf"
    bad.write_bytes(path.read_bytes())
    _poke_tensor_offset(bad, "blk.0.attn_norm.weight", lambda r, i: _relative(r, i) + 4)
    with pytest.raises(ModelLoadError, match=r"misaligned\.gguf.*'blk\.0\.attn_norm\.weight'.*alignment"):
        load_checkpoint(bad)
    bad = tmp_path / "overlap.gguf"
    bad.write_bytes(path.read_bytes())
    _poke_tensor_offset(bad, "blk.0.attn_norm.weight", lambda r, i: _relative(r, i - 1))  # onto its neighbour
    with pytest.raises(ModelLoadError, match=r"overlap\.gguf.*overlap"):
        load_checkpoint(bad)


def test_non_finite_weights_are_refused(tmp_path):
    model = tiny_hf_model("qwen2")
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")
    path = tmp_path / "nan.gguf"
    write_gguf(path, model, "qwen2")
    with pytest.raises(ModelLoadError, match=r"nan\.gguf.*'output_norm\.weight'.*NaN"):
        load_checkpoint(path)
    # a block format's scale (fp16) set to infinity, in a file run as it is by the native kernels
    good = tmp_path / "q8.gguf"
    write_gguf(good, tiny_hf_model("qwen2"), "qwen2")
    from gguf import GGUFReader

    reader = GGUFReader(good)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")  # Q8_0: d is the block's first 2 bytes
    start = int(t.data_offset) + 5 * 34
    del reader
    data = bytearray(good.read_bytes())
    data[start:start + 2] = np.array([np.inf], dtype=np.float16).tobytes()
    bad = tmp_path / "infscale.gguf"
    bad.write_bytes(bytes(data))
    from specfleet.runtime.loading.gguf import read_gguf_native

    with pytest.raises(ModelLoadError, match=r"infscale\.gguf.*'blk\.1\.ffn_down\.weight'.*scales"):
        read_gguf_native(bad)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    model = tiny_hf_model("llama")
    tokens, _ = tiny_vocab()
    model.resize_token_embeddings(len(tokens) - 3)
    path = tmp_path / "short.gguf"
    write_gguf(path, model, "llama")
    with pytest.raises(ModelLoadError, match=rf"short\.gguf.*{len(tokens)} tokens.*{len(tokens) - 3} rows"):
        load_checkpoint(path)
    from specfleet.runtime.loading.load import check_tokenizer_fits

    class Tok:
        def __len__(self):
            return 10

    check_tokenizer_fits(Tok(), 10, "m")
    with pytest.raises(ModelLoadError, match="10 tokens.*9 rows"):
        check_tokenizer_fits(Tok(), 9, "m")


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 10**6), ("num_hidden_layers", 0),
                                        ("hidden_size", 2**30), ("vocab_size", 2**40),
                                        ("max_position_embeddings", 2**40), ("num_key_value_heads", 0)])
def test_hf_config_sizes_are_bounded_as_gguf_ones_are(tmp_path, key, value):
    cfg = tiny_hf_model("qwen2").config.to_dict()
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=rf"{key}={value}.*out of range"):
        load_checkpoint(tmp_path)


def _same_weights(a: dict, b: dict) -> int:
    """Asserts two checkpoints' weights are equal bit for bit; returns how many are QTensors."""
    from specfleet.runtime.formats.qtensor import QTensor

    assert a.keys() == b.keys()
    quantized = 0
    for name, w in a.items():
        v = b[name]
        if isinstance(w, QTensor):
            quantized += 1
            assert isinstance(v, QTensor) and (v.qtype, v.shape) == (w.qtype, w.shape), name
            assert torch.equal(v.data, w.data), name
        else:
            assert torch.equal(v, w), name
    return quantized


def test_requantized_weights_are_kept_and_read_back_bit_for_bit(tmp_path, tmp_cache, monkeypatch):
    """A GGUF file requantized at load (quantization='q4_0' etc.) is requantized once: a later load reads the
    cached bytes back, the same QTensors bit for bit, without requantizing; a damaged cache entry is redone."""
    from specfleet.runtime.loading import gguf as gguf_loader

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf_model("qwen2"), "qwen2")
    firsts = {}
    for fmt in ("q4_0", "q8_0"):
        firsts[fmt] = first = load_checkpoint(path, quantization=fmt)
        assert len(list((tmp_cache / "requantized").glob(f"tiny-{fmt}-*"))) == 1
        with monkeypatch.context() as m:
            m.setattr(gguf_loader, "requantize", lambda *a: pytest.fail("requantized again despite the cache"))
            again = load_checkpoint(path, quantization=fmt)
        assert again.config == first.config
        assert _same_weights(first.weights, again.weights) >= 1  # the tiny file's Q8_0 matrices (F32 ones stay dense)
    (entry,) = (tmp_cache / "requantized").glob("tiny-q4_0-*")
    (entry / "weights.safetensors").write_bytes(b"junk")
    _same_weights(firsts["q4_0"].weights, load_checkpoint(path, quantization="q4_0").weights)
    with monkeypatch.context() as m:  # and rewritten: the next load reads it again
        m.setattr(gguf_loader, "requantize", lambda *a: pytest.fail("requantized again despite the cache"))
        _same_weights(firsts["q4_0"].weights, load_checkpoint(path, quantization="q4_0").weights)
