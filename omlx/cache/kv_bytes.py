"""Cache arrays <-> safetensors bytes, and KV blocks joined or cut along their token
axis (keys/values are (batch, heads, tokens, dim)). MLX thread only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from omlx.cache.safetensors_io import BlockPayload

Tensor = tuple[str, tuple[int, ...], bytes]  # safetensors dtype, shape, raw bytes

_TO_SAFETENSORS = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.int32: "I32",
    mx.uint32: "U32",
    mx.int64: "I64",
}
# How raw bytes of each dtype become an mlx array (bf16 goes through uint16).
_FROM_SAFETENSORS: dict[str, tuple[Any, Any]] = {
    "F32": (np.float32, None),
    "F16": (np.float16, None),
    "BF16": (np.uint16, mx.bfloat16),
    "I32": (np.int32, None),
    "U32": (np.uint32, None),
    "I64": (np.int64, None),
}


def to_bytes(array: mx.array) -> Tensor:
    dtype = _TO_SAFETENSORS.get(array.dtype)
    if dtype is None:
        raise ValueError(f"cannot store a cache array of dtype {array.dtype}")
    return dtype, tuple(array.shape), bytes(memoryview(array))  # type: ignore[arg-type]


def from_bytes(dtype: str, shape: tuple[int, ...], raw: bytes) -> mx.array:
    np_dtype, view = _FROM_SAFETENSORS[dtype]
    array = mx.array(np.frombuffer(raw, dtype=np_dtype)).reshape(shape)
    return array.view(view) if view is not None else array


def cut_payload(payload: BlockPayload, num_tokens: int) -> BlockPayload:
    """A sliceable block's first ``num_tokens`` tokens, as a block of its own (for a
    prompt that shares only them). Every tensor is (1, heads, tokens, ...)."""
    tensors: dict[str, Tensor] = {}
    for name, (dtype, shape, raw) in payload.tensors.items():
        np_dtype = _FROM_SAFETENSORS[dtype][0]
        array = np.frombuffer(raw, dtype=np_dtype).reshape(shape)[:, :, :num_tokens, :]
        tensors[name] = (dtype, tuple(array.shape), np.ascontiguousarray(array).tobytes())
    return replace(
        payload, key=f"{payload.key}:{num_tokens}", num_tokens=num_tokens, tensors=tensors
    )


def joined(parts: Sequence[Tensor], room: int) -> mx.array:
    """Blocks of one KV layer (batch, heads, tokens, dim) back to back, then ``room``
    zeroed tokens: assembled in one host buffer and copied into MLX once (an array
    per block and a concatenation cost more: benchmarks/README.md, "Figures behind
    design choices")."""
    dtype, (batch, heads, _, dim) = parts[0][0], parts[0][1]
    np_dtype, view = _FROM_SAFETENSORS[dtype]
    num = sum(shape[2] for _, shape, _ in parts)
    buf = np.empty((batch, heads, num + room, dim), dtype=np_dtype)
    pos = 0
    for part_dtype, shape, raw in parts:
        if part_dtype != dtype or (shape[0], shape[1], shape[3]) != (batch, heads, dim):
            raise ValueError(f"blocks disagree: {part_dtype}{shape} after {dtype}{parts[0][1]}")
        n = shape[2]
        buf[:, :, pos : pos + n, :] = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
        pos += n
    buf[:, :, num:, :] = 0
    array = mx.array(buf)
    return array.view(view) if view is not None else array
