"""The fast GGUF header reader (runtime/loading/gguf_file.py) against gguf-py's GGUFReader: the same keys,
values and tensors on files of every value type and on the real models, and a clear error on damage."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import real_model_path
from specfleet.errors import ModelLoadError
from specfleet.runtime.loading.gguf import open_gguf
from specfleet.runtime.loading.gguf_file import GGUFFile


def _write(path: Path) -> Path:
    """A small file with a key of every value type and tensors in plain and block formats."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5e-6)
    w.add_uint64("t.u64", 1 << 60)
    w.add_int64("t.i64", -(1 << 60))
    w.add_float64("t.f64", 3.141592653589793)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo <|im_end|>")
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -2.0])
    w.add_array("t.strs", ["a", "", "ünïcode", "<|endoftext|>"] * 50)
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("plain", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((2, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _same_as_gguf_py(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        assert field.contents() == theirs.fields[key].contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.data_offset, a.n_bytes, a.n_elements) == \
               (b.name, b.tensor_type, b.data_offset, b.n_bytes, b.n_elements)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)
    return ours


def test_every_value_type_and_tensor_reads_as_gguf_py_reads_it(tmp_path):
    ours = _same_as_gguf_py(_write(tmp_path / "all.gguf"))
    assert ours.fields["t.str"].contents() == "héllo <|im_end|>"
    strs = ours.fields["t.strs"].value
    assert len(strs) == 200 and strs[2] == "ünïcode" and strs[-1] == "<|endoftext|>" and strs[1:3] == ["", "ünïcode"]
    assert ours.fields["t.ints"].value.tolist() == [3, 1, 4, 1, 5]
    assert ours.alignment == 32 and all(t.data_offset % 32 == 0 for t in ours.tensors)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct"])
def test_a_real_model_file_reads_as_gguf_py_reads_it(name):
    path = real_model_path(name)
    ours = _same_as_gguf_py(path)
    assert len(ours.fields["tokenizer.ggml.tokens"].value) == 49152


def _header(*parts: bytes) -> bytes:
    return b"".join(parts)


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _file(tmp_path: Path, body: bytes, kv_count: int, tensors: int = 0, version: int = 3) -> Path:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, tensors, kv_count) + body + b"\0" * 64)
    return path


def test_damaged_headers_get_a_clear_error(tmp_path):
    strs = _kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + _s("a") + _s("b") + _s("c"))
    assert GGUFFile(_file(tmp_path, strs, 1)).fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    cases = {
        "not a GGUF file": b"GGUX" + b"\0" * 40,
        "version 1 is not supported": b"GGUF" + struct.pack("<IQQ", 1, 0, 0),
        "big-endian": b"GGUF" + struct.pack(">IQQ", 3, 0, 0),
        "duplicate metadata key": _file(tmp_path, _kv("k", 4, b"\1\0\0\0") * 2, 2).read_bytes(),
        "unknown metadata value type 99": _file(tmp_path, _kv("k", 99, b"\0" * 8), 1).read_bytes(),
        # a string array whose last string claims more bytes than the file has
        "strings runs past the end": _file(tmp_path, _kv("t", 9, struct.pack("<IQ", 8, 2) + _s("a")
                                                         + struct.pack("<Q", 1 << 40)), 1).read_bytes(),
        "items runs past the end": _file(tmp_path, _kv("t", 9, struct.pack("<IQ", 4, 1 << 50)), 1).read_bytes(),
        "more than the file's": b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 62),
        "runs past the end of the file": b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1000) + b"ab",
        "alignment=3 is not a power of two": _file(tmp_path, _kv("general.alignment", 4, struct.pack("<I", 3)),
                                                   1).read_bytes(),
        "has 7 dimensions": _file(tmp_path, _s("w") + struct.pack("<I", 7), 0, tensors=1).read_bytes(),
    }
    for message, data in cases.items():
        path = tmp_path / "damaged.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=message):
            GGUFFile(path)
        with pytest.raises(ModelLoadError, match=r"damaged\.gguf is not a readable GGUF file"):
            open_gguf(path)


def test_a_file_cut_inside_its_tensor_data_says_truncated(tmp_path):
    path = _write(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*'q8'.*truncated"):
        open_gguf(cut)
