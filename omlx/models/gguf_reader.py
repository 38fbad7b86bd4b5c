"""Read a GGUF file's header (metadata and tensor table) in pure Python.

The tensors are then read by llama.cpp's gguf-py, which trusts the header: its
sizes come from numpy ints that wrap, and a crafted count or length makes it
allocate or loop without bound. Every field is therefore checked here first,
with Python ints, against what the file can hold; a header that passes is one
gguf-py reads in bounds. Any problem raises ImportFailedError naming the field.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from omlx.errors import ImportFailedError

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count

# Caps a real model stays far below; each keeps a crafted header from costing
# more time or memory than its file size justifies.
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS; llama.cpp refuses more too
MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 16
MAX_ARRAY_LENGTH = 1 << 24
MAX_STRINGS = 1 << 23  # over the whole header: each one becomes a Python object
MAX_STRING_BYTES = 16 << 20
MAX_ALIGNMENT = 1 << 16
# MLX keeps shapes in 32-bit ints.
MAX_TENSOR_ELEMENTS = 2**31 - 1
# Smallest encoding of one entry: bounds a count by the bytes left in the file.
_MIN_KEY_VALUE_BYTES = 8 + 4 + 1  # empty key, value type, one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims, type, offset
_STRING_PREFIX_BYTES = 8
_TRUNCATED = " (is the file truncated or corrupt?)"

# GGUF metadata value types -> struct format (8 = string, 9 = array).
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY, _UINT32 = 8, 9, 4

# ggml tensor types: id -> (name, elements per block, bytes per block).
# These are the ones gguf-py's gguf.quants decodes (llama.cpp's reference code).
_DECODABLE = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4",
)  # fmt: skip
SUPPORTED_TYPES = {
    int(GGMLQuantizationType[name]): (name, *GGML_QUANT_SIZES[GGMLQuantizationType[name]])
    for name in _DECODABLE
}
# Names for the other types, so the error can say what was found.
_OTHER_TYPE_NAMES = {
    int(kind): kind.name for kind in GGMLQuantizationType if int(kind) not in SUPPORTED_TYPES
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # MLX order (rows first), the reverse of ggml's
    type_name: str
    start: int = 0  # where its data begins in the file (checked in bounds)
    num_bytes: int = 0


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # numeric arrays are numpy arrays, strings are str
    tensors: list[TensorInfo]


@dataclass(frozen=True, slots=True)
class _RawTensor:
    name: str
    dims: tuple[int, ...]  # ggml order (row length first)
    type_id: int
    offset: int  # from the start of the data section


def type_name(type_id: int) -> str:
    if type_id in SUPPORTED_TYPES:
        return SUPPORTED_TYPES[type_id][0]
    return _OTHER_TYPE_NAMES.get(type_id, f"unknown type {type_id}")


def read_header(path: Path) -> GGUFHeader:
    """Parse and validate a GGUF header; any problem raises ImportFailedError."""
    try:
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_size == 0:  # mmap refuses empty files
                raise ImportFailedError(f"{path.name} is not a GGUF file (it is empty)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Cursor(buf, path.name))
    except OSError as exc:
        raise ImportFailedError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except MemoryError as exc:
        raise ImportFailedError(f"{path.name}: its header does not fit in memory") from exc


class _Cursor:
    """Reads fields in order; every read is checked against the file's end."""

    def __init__(self, buf: mmap.mmap, file_name: str):
        self.buf = buf
        self.size = len(buf)
        self.file_name = file_name
        self.pos = 0
        self.strings_left = MAX_STRINGS

    def fail(self, message: str) -> ImportFailedError:
        return ImportFailedError(f"{self.file_name}: {message}")

    def take(self, num_bytes: int, what: str) -> int:
        """Advance past ``num_bytes``; the start offset, or a truncation error."""
        if num_bytes > self.size - self.pos:
            raise self.fail(
                f"{what} needs {num_bytes} bytes but only {self.size - self.pos} remain: "
                "the file is truncated or corrupt (incomplete download?)"
            )
        start, self.pos = self.pos, self.pos + num_bytes
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, min_entry_bytes: int, cap: int) -> int:
        """A u64 entry count, bounded by ``cap`` and by what the rest of the file can hold."""
        value = int(self.unpack("<Q", what))
        if value > cap:
            raise self.fail(f"{what} is {value}: more than the limit of {cap}")
        if value * min_entry_bytes > self.size - self.pos:
            raise self.fail(
                f"{what} is {value}, but only {self.size - self.pos} bytes remain for them: "
                "the file is truncated or corrupt"
            )
        return value

    def string(self, what: str) -> str:
        length = int(self.unpack("<Q", f"the length of {what}"))
        if length > MAX_STRING_BYTES:
            raise self.fail(f"{what} is {length} bytes long: more than the limit of 16 MiB")
        self.strings_left -= 1
        if self.strings_left < 0:
            raise self.fail(f"the header holds more than {MAX_STRINGS} strings")
        start = self.take(length, what)
        try:
            return self.buf[start : self.pos].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value(self, kind: int, key: str) -> Any:
        if kind == _STRING:
            return self.string(f"the value of '{key}'")
        if kind == _ARRAY:
            return self.array(key)
        if kind not in _SCALAR_FORMATS:
            raise self.fail(f"metadata '{key}' has unknown value type {kind}")
        return self.unpack(_SCALAR_FORMATS[kind], f"the value of '{key}'")

    def array(self, key: str) -> Any:
        kind = self.unpack("<I", f"the element type of '{key}'")
        what = f"the length of array '{key}'"
        if kind == _ARRAY:  # llama.cpp does not load nested arrays
            raise self.fail(f"metadata '{key}' is an array of arrays, which is not supported")
        if kind == _STRING:
            count = self.count(what, _STRING_PREFIX_BYTES, MAX_ARRAY_LENGTH)
            return [self.string(f"entry {i} of '{key}'") for i in range(count)]
        if kind not in _SCALAR_FORMATS:
            raise self.fail(f"array '{key}' has unknown element type {kind}")
        dtype = np.dtype(_SCALAR_FORMATS[kind].replace("?", "b1"))
        count = self.count(what, dtype.itemsize, MAX_ARRAY_LENGTH)
        start = self.take(count * dtype.itemsize, f"array '{key}'")
        return np.frombuffer(self.buf[start : self.pos], dtype=dtype)


def _parse(cur: _Cursor) -> GGUFHeader:
    if cur.size < 4 or cur.buf[:4] != GGUF_MAGIC:
        raise cur.fail("not a GGUF file (wrong magic bytes)")
    cur.take(4, "the magic bytes")
    version = cur.unpack("<I", "the GGUF version")
    if version not in (2, 3):
        raise cur.fail(f"GGUF version {version} is not supported (2 or 3)")
    num_tensors = cur.count("the tensor count", 0, MAX_TENSORS)  # bounded below, once keys are read
    num_keys = cur.count("the metadata key count", _MIN_KEY_VALUE_BYTES, MAX_KEYS)
    metadata, alignment = _read_metadata(cur, num_keys)
    if num_tensors * _MIN_TENSOR_INFO_BYTES > cur.size - cur.pos:
        raise cur.fail(
            f"the tensor count is {num_tensors}, but only {cur.size - cur.pos} bytes remain "
            "for them: the file is truncated or corrupt"
        )
    raw = [_read_tensor_info(cur, i) for i in range(num_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    tensors = _check_tensors(cur, raw, data_start, alignment)
    return GGUFHeader(version, metadata, tensors)


def _read_metadata(cur: _Cursor, num_keys: int) -> tuple[dict[str, Any], int]:
    """The key/value pairs and the data alignment they set."""
    metadata: dict[str, Any] = {}
    alignment = _DEFAULT_ALIGNMENT
    for index in range(num_keys):
        key = cur.string(f"the name of metadata key {index}")
        if key in metadata:
            raise cur.fail(f"metadata key '{key}' appears twice")
        kind = cur.unpack("<I", f"the value type of '{key}'")
        metadata[key] = cur.value(kind, key)
        if key == "general.alignment":
            alignment = _check_alignment(cur, kind, metadata[key])
    return metadata, alignment


def _check_alignment(cur: _Cursor, kind: int, value: Any) -> int:
    # gguf-py honours general.alignment only as a uint32: any other type
    # would make it read the tensors from other offsets than the ones checked here.
    if kind != _UINT32:
        raise cur.fail("general.alignment must be a uint32")
    if not 1 <= value <= MAX_ALIGNMENT or value & (value - 1):
        raise cur.fail(
            f"general.alignment is {value}: it must be a power of two from 1 to {MAX_ALIGNMENT}"
        )
    return int(value)


def _read_tensor_info(cur: _Cursor, index: int) -> _RawTensor:
    name = cur.string(f"the name of tensor {index}")
    num_dims = cur.unpack("<I", f"the dimension count of tensor '{name}'")
    if num_dims > MAX_DIMS:
        raise cur.fail(f"tensor '{name}' has {num_dims} dimensions: GGUF allows at most {MAX_DIMS}")
    dims = tuple(
        int(cur.unpack("<Q", f"dimension {i} of tensor '{name}'")) for i in range(num_dims)
    )
    type_id = cur.unpack("<I", f"the type of tensor '{name}'")
    offset = int(cur.unpack("<Q", f"the data offset of tensor '{name}'"))
    return _RawTensor(name, dims, type_id, offset)


def _check_tensors(
    cur: _Cursor, raw: list[_RawTensor], data_start: int, alignment: int
) -> list[TensorInfo]:
    """Types, sizes and offsets of every tensor; no two may share bytes."""
    if raw and data_start > cur.size:
        raise cur.fail(
            f"the tensor data would start at byte {data_start}, past the end of the file "
            f"({cur.size} bytes): the file is truncated"
        )
    seen: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    infos: list[TensorInfo] = []
    for tensor in raw:
        if tensor.name in seen:
            raise cur.fail(f"tensor '{tensor.name}' appears twice")
        seen.add(tensor.name)
        num_bytes = _tensor_bytes(cur, tensor, cur.size - data_start)
        spans.append(_tensor_span(cur, tensor, num_bytes, data_start, alignment))
        kind = SUPPORTED_TYPES[tensor.type_id][0]
        shape = tuple(reversed(tensor.dims))
        infos.append(TensorInfo(tensor.name, shape, kind, spans[-1][0], num_bytes))
    _check_no_overlap(cur, spans)
    return infos


def _tensor_bytes(cur: _Cursor, tensor: _RawTensor, data_bytes: int) -> int:
    """Bytes ``tensor`` takes in the file, computed with Python ints (no wrap-around)."""
    name = tensor.name
    if tensor.type_id not in SUPPORTED_TYPES:
        supported = ", ".join(n for n, _, _ in SUPPORTED_TYPES.values())
        raise cur.fail(
            f"tensor {name} has type {type_name(tensor.type_id)}, which cannot be "
            f"imported (supported: {supported})"
        )
    label, block, block_bytes = SUPPORTED_TYPES[tensor.type_id]
    for i, dim in enumerate(tensor.dims):
        if -(-dim // block) * block_bytes > data_bytes:
            raise cur.fail(
                f"tensor '{name}' dimension {i} is {dim}: larger than the file's "
                f"{data_bytes} bytes of tensor data{_TRUNCATED}"
            )
    elements = math.prod(tensor.dims)  # a Python int: exact, never wraps
    row = tensor.dims[0] if tensor.dims else 1
    if row % block:
        raise cur.fail(
            f"tensor {name} ({label}) has rows of {row}, not a multiple of its block size {block}"
        )
    num_bytes = elements // block * block_bytes
    if num_bytes > data_bytes:
        raise cur.fail(
            f"tensor '{name}' ({label}, shape {list(reversed(tensor.dims))}) needs {num_bytes} "
            f"bytes: larger than the file's {data_bytes} bytes of tensor data{_TRUNCATED}"
        )
    if elements > MAX_TENSOR_ELEMENTS:
        raise cur.fail(
            f"tensor '{name}' has {elements} elements: more than mlx's GGUF reader "
            f"handles ({MAX_TENSOR_ELEMENTS})"
        )
    return num_bytes


def _tensor_span(
    cur: _Cursor, tensor: _RawTensor, num_bytes: int, data_start: int, alignment: int
) -> tuple[int, int, str]:
    if tensor.offset % alignment:
        raise cur.fail(
            f"tensor '{tensor.name}' data offset {tensor.offset} is not a multiple of the "
            f"alignment {alignment}"
        )
    start = data_start + tensor.offset
    if start + num_bytes > cur.size:
        raise cur.fail(
            f"the file is truncated: tensor {tensor.name} extends past the end of the file "
            "(incomplete download?)"
        )
    return start, start + num_bytes, tensor.name


def _check_no_overlap(cur: _Cursor, spans: list[tuple[int, int, str]]) -> None:
    ordered = sorted(spans)
    for (_, end, first), (start, _, second) in itertools.pairwise(ordered):
        if start < end:
            raise cur.fail(f"tensors '{first}' and '{second}' overlap in the file")


# -- typed metadata ------------------------------------------------------------
# Metadata values are whatever the file says; these turn one into the type a
# field needs, or raise ImportFailedError naming the key.

MAX_INT32 = 2**31 - 1


def _kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | np.ndarray):
        return "an array"
    return "a number"


def as_int(key: str, value: Any, *, low: int = 0, high: int = MAX_INT32) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ImportFailedError(f"{key} must be an integer, not {_kind_of(value)}")
    if not low <= int(value) <= high:
        raise ImportFailedError(f"{key} is {value}: it must be from {low} to {high}")
    return int(value)


def as_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ImportFailedError(f"{key} must be a number, not {_kind_of(value)}")
    if not np.isfinite(value):
        raise ImportFailedError(f"{key} is {value}: it must be a finite number")
    return float(value)


def as_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool | int):
        raise ImportFailedError(f"{key} must be a boolean, not {_kind_of(value)}")
    return bool(value)


def as_str(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ImportFailedError(f"{key} must be a string, not {_kind_of(value)}")
    return value


def as_str_list(key: str, value: Any) -> list[str]:
    if not isinstance(value, list):  # string arrays are read as lists of str
        raise ImportFailedError(f"{key} must be an array of strings, not {_kind_of(value)}")
    return value


def as_int_array(key: str, value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu":
        raise ImportFailedError(f"{key} must be an array of integers, not {_kind_of(value)}")
    return value
