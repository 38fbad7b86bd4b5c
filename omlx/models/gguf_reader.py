"""Read a GGUF file's header (metadata and tensor table) in pure Python.

``mx.load`` reads the tensors, but it stops silently at the first tensor type
its reader does not know (every later tensor is dropped) and reports bad files
as bare ``gguf_init failed``. Checking the header here first turns both into
clear errors.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omlx.errors import ImportFailedError

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (8 = string, 9 = array).
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9

# ggml tensor types: id -> (name, elements per block, bytes per block).
# Only these load correctly through mx.load: the Q4/Q8 types come back as MLX
# affine triples, Q6_K and BF16 are decoded to float16 by mlx's gguf reader.
SUPPORTED_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
# Names for the usual unsupported types, so the error can say what was found.
_OTHER_TYPE_NAMES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K",
    15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL",
    21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64",
    28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # MLX order (rows first), the reverse of ggml's
    type_name: str


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # numeric arrays are numpy arrays, strings are str
    tensors: list[TensorInfo]


def type_name(type_id: int) -> str:
    if type_id in SUPPORTED_TYPES:
        return SUPPORTED_TYPES[type_id][0]
    return _OTHER_TYPE_NAMES.get(type_id, f"unknown type {type_id}")


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        end = self.pos + size
        if end > len(self.buf):
            raise struct.error("string past end of file")
        text = self.buf[self.pos : end].decode("utf-8")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.unpack(_SCALAR_FORMATS[kind])

    def array(self) -> Any:
        kind, count = self.unpack("<I"), self.unpack("<Q")
        if kind == _STRING:
            return [self.string() for _ in range(count)]
        if kind == _ARRAY:
            return [self.array() for _ in range(count)]
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata array type {kind}")
        dtype = np.dtype(_SCALAR_FORMATS[kind].replace("?", "b1"))
        end = self.pos + count * dtype.itemsize
        if end > len(self.buf):
            raise struct.error("array past end of file")
        values = np.frombuffer(self.buf[self.pos : end], dtype=dtype)
        self.pos = end
        return values


def read_header(path: Path) -> GGUFHeader:
    """Parse and validate a GGUF header; any problem raises ImportFailedError."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path)
    except ImportFailedError:
        raise
    except ValueError as exc:
        if "empty file" in str(exc):  # mmap refuses empty files
            raise ImportFailedError(f"{path.name} is not a GGUF file (it is empty)") from exc
        raise ImportFailedError(f"{path.name} is corrupt: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ImportFailedError(f"{path.name} is corrupt (a metadata string is not UTF-8)") from exc
    except (struct.error, MemoryError) as exc:
        raise ImportFailedError(
            f"{path.name} is truncated or corrupt (its header ends early)"
        ) from exc
    except OSError as exc:
        raise ImportFailedError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _parse(buf: mmap.mmap, path: Path) -> GGUFHeader:
    if buf[:4] != GGUF_MAGIC:
        raise ImportFailedError(f"{path.name} is not a GGUF file (wrong magic bytes)")
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ImportFailedError(f"{path.name}: GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = [_tensor_info(cur) for _ in range(num_tensors)]
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = [_check_tensor(info, data_start, len(buf), path) for info in infos]
    return GGUFHeader(version, metadata, tensors)


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    num_dims = cur.unpack("<I")
    dims = tuple(cur.unpack("<Q") for _ in range(num_dims))
    type_id, offset = cur.unpack("<I"), cur.unpack("<Q")
    return name, tuple(reversed(dims)), type_id, offset


def _check_tensor(
    info: tuple[str, tuple[int, ...], int, int], data_start: int, file_bytes: int, path: Path
) -> TensorInfo:
    name, shape, type_id, offset = info
    if type_id not in SUPPORTED_TYPES:
        supported = ", ".join(n for n, _, _ in SUPPORTED_TYPES.values())
        raise ImportFailedError(
            f"{path.name}: tensor {name} has type {type_name(type_id)}, which cannot be "
            f"imported (supported: {supported})"
        )
    type_label, block, block_bytes = SUPPORTED_TYPES[type_id]
    row = shape[-1] if shape else 1
    if row % block:
        raise ImportFailedError(
            f"{path.name}: tensor {name} ({type_label}) has rows of {row}, "
            f"not a multiple of its block size {block}"
        )
    num_bytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
    if data_start + offset + num_bytes > file_bytes:
        raise ImportFailedError(
            f"{path.name} is truncated: tensor {name} extends past the end of the file "
            "(incomplete download?)"
        )
    return TensorInfo(name, shape, type_label)
