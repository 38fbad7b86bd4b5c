"""A minimal safetensors writer and reader over raw bytes (no numpy, no mlx).

Layout: 8-byte little-endian header length, a JSON header mapping each tensor
name to ``{dtype, shape, data_offsets}`` plus a ``__metadata__`` dict of
str -> str, then the tensors' bytes back to back in the order of their offsets.
Files written here carry a blake2b checksum of the data section in the
metadata (``CHECKSUM_KEY``); ``read`` refuses a file whose data does not match.

The second half maps one KV block (``BlockPayload``) to such a file, with the
block's identity (format version, key, model, layer layout, block size, token
count) in the metadata.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
# A header this large is not one of ours; refuse it before allocating.
MAX_HEADER_BYTES = 16 * 1024 * 1024
CHECKSUM_KEY = "checksum"

# name -> (dtype, shape, raw bytes)
Tensors = Mapping[str, tuple[str, tuple[int, ...], bytes]]


class SafetensorsFormatError(ValueError):
    """The bytes are not a well-formed safetensors file (truncated, garbage, bad header)."""


def check_tensor(name: str, dtype: str, shape: tuple[int, ...], num_bytes: int) -> None:
    """Raise ValueError unless ``num_bytes`` is exactly what ``dtype`` x ``shape`` needs."""
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if num_bytes != expected:
        raise ValueError(
            f"tensor {name!r}: {num_bytes} bytes, {dtype}{list(shape)} needs {expected}"
        )


def _checksum(chunks: list[bytes]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def encode(tensors: Tensors, metadata: Mapping[str, str]) -> tuple[bytes, list[bytes]]:
    """Return (header bytes including the length prefix, data chunks in file order)."""
    header: dict[str, object] = {}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        check_tensor(name, dtype, tuple(shape), len(raw))
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    header["__metadata__"] = {**metadata, CHECKSUM_KEY: _checksum(chunks)}
    body = json.dumps(header, separators=(",", ":")).encode()
    # safetensors pads the header with spaces so the data starts 8-byte aligned.
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body, chunks


def read_header(
    f: BinaryIO, file_size: int
) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """Read only the header. Return (tensor entries, metadata, data start offset).

    Checks that the entries tile the data section exactly and that the data
    section is as long as the file says, so a truncated file fails here.
    """
    prefix = f.read(8)
    if len(prefix) != 8:
        raise SafetensorsFormatError("file shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise SafetensorsFormatError(f"header length {header_len} does not fit the file")
    raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsFormatError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("header is not a JSON object")
    # Writers that have no metadata (mx.save_safetensors) store null.
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsFormatError("__metadata__ must map str to str")
    data_start = 8 + header_len
    _check_entries(header, file_size - data_start)
    return header, metadata, data_start


def _check_entries(entries: dict[str, object], data_len: int) -> None:
    spans = []
    for name, entry in entries.items():
        try:
            dtype, shape = entry["dtype"], tuple(entry["shape"])  # type: ignore[index]
            start, end = entry["data_offsets"]  # type: ignore[index]
            check_tensor(name, dtype, shape, end - start)
        except (TypeError, KeyError, ValueError) as e:
            raise SafetensorsFormatError(f"bad entry {name!r}: {e}") from None
        spans.append((start, end))
    position = 0
    for start, end in sorted(spans):
        if start != position:
            raise SafetensorsFormatError("tensor data offsets leave a gap or overlap")
        position = end
    if position != data_len:
        raise SafetensorsFormatError(f"data section is {data_len} bytes, header says {position}")


def read(
    f: BinaryIO, file_size: int
) -> tuple[dict[str, tuple[str, tuple[int, ...], bytes]], dict[str, str]]:
    """Read and verify a whole file written by ``encode``. Return (tensors, metadata).

    Raises SafetensorsFormatError if the file is malformed, truncated, or its
    data does not match the checksum in its metadata (a missing checksum fails too).
    """
    entries, metadata, data_start = read_header(f, file_size)
    data = f.read(file_size - data_start)
    if len(data) != file_size - data_start:
        raise SafetensorsFormatError("file ended inside the data section")
    if metadata.get(CHECKSUM_KEY) != _checksum([data]):
        raise SafetensorsFormatError("checksum mismatch")
    tensors = {}
    for name, entry in entries.items():
        start, end = entry["data_offsets"]
        tensors[name] = (entry["dtype"], tuple(entry["shape"]), data[start:end])
    return tensors, metadata


# -- KV block files ---------------------------------------------------------

BLOCK_FORMAT_VERSION = "1"


@dataclass(frozen=True, slots=True)
class BlockPayload:
    """One KV block as bytes. ``tensors``: name -> (safetensors dtype, shape, raw bytes)."""

    key: str
    model_identity: str
    num_tokens: int
    block_size: int
    layer_layout: tuple[str, ...]
    tensors: Tensors


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """What a cache holds; a block file written for another spec is incompatible."""

    model_identity: str
    layer_layout: tuple[str, ...]
    block_size: int

    def check_payload(self, payload: BlockPayload) -> None:
        """Raise ValueError unless ``payload`` matches this spec and its tensors are consistent."""
        theirs = BlockSpec(payload.model_identity, tuple(payload.layer_layout), payload.block_size)
        if theirs != self:
            raise ValueError(f"payload for {theirs} does not belong with {self}")
        for name, (dtype, shape, raw) in payload.tensors.items():
            check_tensor(name, dtype, tuple(shape), len(raw))

    def metadata(self, key: str) -> dict[str, str]:
        return {
            "format_version": BLOCK_FORMAT_VERSION,
            "key": key,
            "model_identity": self.model_identity,
            "layer_layout": json.dumps(list(self.layer_layout)),
            "block_size": str(self.block_size),
        }


def encode_block(payload: BlockPayload) -> tuple[bytes, list[bytes]]:
    spec = BlockSpec(payload.model_identity, tuple(payload.layer_layout), payload.block_size)
    metadata = {**spec.metadata(payload.key), "num_tokens": str(payload.num_tokens)}
    return encode(payload.tensors, metadata)


def _num_tokens(metadata: dict[str, str], key: str, spec: BlockSpec) -> int:
    """Raise ValueError unless the file is block ``key`` written for ``spec``."""
    for name, value in spec.metadata(key).items():
        if metadata.get(name) != value:
            raise ValueError(f"incompatible {name}: {metadata.get(name)!r} != {value!r}")
    try:
        return int(metadata.get("num_tokens", ""))
    except ValueError:
        raise SafetensorsFormatError("num_tokens missing or not an int") from None


def read_block_tokens(f: BinaryIO, file_size: int, key: str, spec: BlockSpec) -> int:
    """Check a block file from its header alone; return its token count."""
    _, metadata, _ = read_header(f, file_size)
    return _num_tokens(metadata, key, spec)


def read_block(f: BinaryIO, file_size: int, key: str, spec: BlockSpec) -> BlockPayload:
    """Read and verify (checksum, spec) block ``key``."""
    tensors, metadata = read(f, file_size)
    num_tokens = _num_tokens(metadata, key, spec)
    return BlockPayload(
        key, spec.model_identity, num_tokens, spec.block_size, spec.layer_layout, tensors
    )
