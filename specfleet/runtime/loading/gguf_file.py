"""A GGUF file's header, read in a fraction of a second: its metadata and its tensors' places in the file.

gguf-py's `GGUFReader` makes two numpy views of the memory map for every string of every metadata array; a
Qwen2.5 file's tokenizer holds ~150k tokens and ~150k merges, so opening either Qwen file took 7.8 s on a
2.5 GHz Xeon, paid again by every model a process loads (the target, then each draft). Here a string array
is only walked, its starts and lengths noted in two integer arrays, and a string is decoded when asked
for; a number array is one `np.frombuffer` view. The loader reads a handful of keys and the tensors, so
that is all it pays for. gguf-py stays the source of the format's constants (value and block types, block
sizes) and of the dequantizers; writing files stays with its GGUFWriter.

Only little-endian files of GGUF versions 2 and 3 are read (the ones llama.cpp writes); anything else, and
every inconsistency of the header (a length past the end of the file, an unknown type, a duplicate key or
tensor name, a bad alignment), is a ValueError naming what was wrong, which `gguf.open_gguf` turns into a
ModelLoadError.
"""
from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = 0x46554747  # "GGUF" read as a little-endian uint32
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32

V = GGUFValueType
# value type -> (struct format, numpy dtype) of the fixed-size scalars
_SCALARS: dict[GGUFValueType, tuple[str, np.dtype]] = {
    V.UINT8: ("<B", np.dtype("<u1")), V.INT8: ("<b", np.dtype("<i1")), V.UINT16: ("<H", np.dtype("<u2")),
    V.INT16: ("<h", np.dtype("<i2")), V.UINT32: ("<I", np.dtype("<u4")), V.INT32: ("<i", np.dtype("<i4")),
    V.FLOAT32: ("<f", np.dtype("<f4")), V.BOOL: ("<?", np.dtype("?")), V.UINT64: ("<Q", np.dtype("<u8")),
    V.INT64: ("<q", np.dtype("<i8")), V.FLOAT64: ("<d", np.dtype("<f8")),
}
# tensor types gguf-py hands out as numbers rather than as the bytes of their blocks
_PLAIN_TENSORS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


class StringArray(Sequence):
    """A metadata array of strings, decoded one at a time when indexed (UTF-8; bytes that are not become U+FFFD)."""

    def __init__(self, buf, starts: np.ndarray, lengths: np.ndarray):
        self._buf, self._starts, self._lengths = buf, starts, lengths

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        start = int(self._starts[i])
        return self._buf[start:start + int(self._lengths[i])].decode("utf-8", "replace")


@dataclass(frozen=True)
class Field:
    """One metadata key: its value type (for an array, `item_type` too) and its value: a Python scalar or str,
    a read-only numpy array for an array of numbers, a StringArray, or a list for an array of arrays."""
    name: str
    type: GGUFValueType
    value: Any
    item_type: GGUFValueType | None = None

    def contents(self) -> Any:
        """The value as plain Python: scalars and strings as they are, arrays as lists."""
        if isinstance(self.value, np.ndarray):
            return self.value.tolist()
        if isinstance(self.value, StringArray):
            return list(self.value)
        return self.value


@dataclass(frozen=True)
class Tensor:
    """A tensor's header entry. `shape` is in GGUF order (innermost dimension first), as gguf-py gives it;
    `data` is a read-only view of the file: numbers for F32/F16/F64 and the integer types, else the bytes of
    its blocks, shaped [..., bytes per row] (as gguf-py's ReaderTensor.data, which `gguf.dequantize` takes)."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The header of the GGUF file at `path`, its tensors' data memory-mapped (read-only, never copied):
    `fields` (key -> Field, in file order), `tensors` (in file order), `alignment`, `mmap` (the map itself,
    for madvise) and `data` (the whole file as a uint8 array over that map)."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = len(self.mmap)
        self.data = np.frombuffer(self.mmap, dtype=np.uint8)
        self.fields: dict[str, Field] = {}
        self.tensors: list[Tensor] = []
        self._off = 0
        if self.size < 24 or self._scalar("<I") != GGUF_MAGIC:
            raise ValueError("not a GGUF file (its first bytes are not the GGUF magic)")
        version = self._scalar("<I")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in VERSIONS:
                raise ValueError("a big-endian GGUF file; only little-endian files are read")
            raise ValueError(f"GGUF version {version} is not supported (versions {VERSIONS} are)")
        self.version = version
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        if tensor_count > self.size or kv_count > self.size:  # each entry takes bytes: a count past the size is junk
            raise ValueError(f"the header claims {tensor_count:,} tensors and {kv_count:,} keys, more than the "
                             f"file's {self.size:,} bytes could hold")
        for _ in range(kv_count):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            vtype = self._value_type()
            if vtype == V.ARRAY:
                item_type, value = self._array()
                self.fields[key] = Field(key, vtype, value, item_type)
            else:
                self.fields[key] = Field(key, vtype, self._value(vtype))
        entries = [self._tensor_entry() for _ in range(tensor_count)]
        self.alignment = self._alignment()
        start = -(-self._off // self.alignment) * self.alignment
        names = set()
        for name, dims, ttype, rel in entries:
            if name in names:
                raise ValueError(f"duplicate tensor name {name!r}")
            names.add(name)
            self.tensors.append(self._tensor(name, dims, ttype, start + rel))

    # --- reading the header, front to back -------------------------------------------------------------------
    def _take(self, n: int) -> int:
        """The current offset, then move past `n` bytes that must lie inside the file."""
        off = self._off
        if n < 0 or off + n > self.size:
            raise ValueError(f"the header runs past the end of the file (at byte {off:,}, {n:,} more bytes wanted, "
                             f"{self.size:,} in the file): truncated or corrupt")
        self._off = off + n
        return off

    def _scalar(self, fmt: str):
        return struct.unpack_from(fmt, self.mmap, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        n = self._scalar("<Q")
        off = self._take(n)
        return self.mmap[off:off + n].decode("utf-8", "replace")

    def _value_type(self) -> GGUFValueType:
        raw = self._scalar("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"unknown metadata value type {raw} at byte {self._off - 4:,}") from None

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == V.STRING:
            return self._string()
        if vtype == V.ARRAY:
            return self._array()[1]
        return self._scalar(_SCALARS[vtype][0])

    def _array(self) -> tuple[GGUFValueType, Any]:
        item_type, count = self._value_type(), self._scalar("<Q")
        if count > self.size - self._off:  # every item takes at least one byte
            raise ValueError(f"a metadata array of {count:,} items runs past the end of the file")
        if item_type in _SCALARS:
            dtype = _SCALARS[item_type][1]
            off = self._take(count * dtype.itemsize)
            return item_type, np.frombuffer(self.mmap, dtype=dtype, count=count, offset=off)
        if item_type == V.STRING:
            starts, lengths = np.empty(count, np.int64), np.empty(count, np.int64)
            buf, off, size, unpack = self.mmap, self._off, self.size, struct.Struct("<Q").unpack_from
            for i in range(count):
                if off + 8 > size:
                    break
                (n,) = unpack(buf, off)
                starts[i], lengths[i] = off + 8, n
                off += 8 + n
            if off > size or (count and starts[count - 1] + lengths[count - 1] > size):
                raise ValueError(f"a metadata array of {count:,} strings runs past the end of the file")
            self._off = off
            return item_type, StringArray(buf, starts, lengths)
        return item_type, [self._value(item_type) for _ in range(count)]  # arrays of arrays: rare and small

    def _tensor_entry(self) -> tuple[str, list[int], GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} are possible)")
        dims = [self._scalar("<Q") for _ in range(n_dims)]
        raw = self._scalar("<I")
        try:
            ttype = GGMLQuantizationType(raw)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown type {raw}") from None
        return name, dims, ttype, self._scalar("<Q")

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return DEFAULT_ALIGNMENT
        if field.type != V.UINT32:
            raise ValueError(f"general.alignment must be a UINT32, not {field.type.name}")
        if field.value == 0 or field.value & (field.value - 1):
            raise ValueError(f"general.alignment={field.value} is not a power of two")
        return int(field.value)

    def _tensor(self, name: str, dims: list[int], ttype: GGMLQuantizationType, offset: int) -> Tensor:
        n_elements = int(np.prod(dims, dtype=object))
        block, type_size = GGML_QUANT_SIZES[ttype]
        if n_elements % block or dims[0] % block:
            raise ValueError(f"tensor {name!r} of shape {dims} does not divide into {ttype.name}'s "
                             f"{block}-value blocks")
        n_bytes = n_elements // block * type_size
        if offset + n_bytes > self.size:
            raise ValueError(f"tensor {name!r} ends at byte {offset + n_bytes:,}, past the end of the file "
                             f"({self.size:,} bytes): truncated")
        np_dims = tuple(reversed(dims))
        plain = _PLAIN_TENSORS.get(ttype)
        if plain is not None:
            data = np.frombuffer(self.mmap, dtype=plain, count=n_elements, offset=offset).reshape(np_dims)
        else:
            data = np.frombuffer(self.mmap, dtype=np.uint8, count=n_bytes, offset=offset)
            data = data.reshape(quant_shape_to_byte_shape(np_dims, ttype))
        return Tensor(name, ttype, np.asarray(dims, dtype=np.uint64), n_elements, n_bytes, offset, data)
