"""Turn a GGUF's tensors into MLX arrays, read and decoded by llama.cpp's gguf-py.

Three routes, per tensor type, for dtype "keep":

- Q4_0, Q4_1, Q8_0, Q4_K and Q5_K are affine codes on groups of 32, which is
  MLX's own format: their codes and block scales are repacked, exact (the
  K-quants' scales are rounded to float16).
- Every other quantized type (Q2_K, Q3_K and Q6_K use groups of 16, which MLX
  lacks; IQ*, TQ*, Q5_0/Q5_1, MXFP4) is decoded by ``gguf.quants`` and
  requantized by MLX at two more bits than the source: MLX's step is then
  about a quarter of the source's, so the error it adds stays small against
  the error the GGUF already has.
- Float tensors stay float.

dtype "float32" / "float16" decodes every tensor with ``gguf.quants``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from omlx.errors import ImportFailedError
from omlx.models.gguf_reader import TensorInfo

DType = Literal["float32", "float16", "keep"]
GROUP_SIZE = 32  # MLX's smallest group; every exact route uses blocks of 32
Q = GGMLQuantizationType
_FLOATS = {Q.F32: mx.float32, Q.F16: mx.float16, Q.BF16: mx.bfloat16}
# Requantization bits: the source's nominal bits + 2, within MLX's 2..8.
REQUANT_BITS = {
    Q.Q2_K: 4, Q.Q3_K: 5, Q.Q6_K: 8, Q.Q5_0: 8, Q.Q5_1: 8,
    Q.IQ1_S: 4, Q.IQ1_M: 4, Q.IQ2_XXS: 4, Q.IQ2_XS: 4, Q.IQ2_S: 4, Q.TQ1_0: 4, Q.TQ2_0: 4,
    Q.IQ3_XXS: 5, Q.IQ3_S: 5, Q.IQ4_NL: 6, Q.IQ4_XS: 6, Q.MXFP4: 6,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Converted:
    """One GGUF tensor as MLX arrays: "weight", plus "scales"/"biases" when quantized."""

    arrays: dict[str, mx.array]
    shape: tuple[int, ...]  # the logical (dequantized) shape, rows first
    bits: int | None  # MLX bits when quantized
    route: str  # what happened to it, for the import result


def iter_tensors(path: Path, tensors: list[TensorInfo]) -> Iterator[tuple[TensorInfo, np.ndarray]]:
    """(info, raw bytes as (rows, bytes per row)) for each tensor read_header validated.

    The file is memory-mapped, so a tensor's bytes are read when it is converted.
    """
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ImportFailedError(f"cannot read {path}: {exc}") from exc
    for info in tensors:
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        raw = data[info.start : info.start + info.num_bytes]
        yield info, raw.reshape(rows, -1) if info.num_bytes else raw.reshape(rows, 0)


def convert_tensor(
    info: TensorInfo, raw: np.ndarray, dtype: DType, *, offset: float = 0.0
) -> Converted:
    """``raw`` (``info``'s bytes) in MLX form; ``offset`` is added to a float-stored
    tensor's values (Gemma's norms) before any rounding to float16."""
    kind = GGMLQuantizationType[info.type_name]
    shape = info.shape
    quantized = kind not in _FLOATS
    if dtype == "keep" and quantized and len(shape) == 2 and not offset:
        if kind in _EXACT:
            return _exact(raw, kind, shape)
        return _requantize(_decode(raw, kind, shape), REQUANT_BITS[kind], shape)
    values = _decode(raw, kind, shape) + offset
    if dtype == "keep":  # a float tensor, or a quantized vector (never in real files)
        target = _FLOATS.get(kind, mx.float32)
        route = f"kept as {str(target).removeprefix('mlx.core.')}"
        return Converted({"weight": values.astype(target)}, shape, None, route)
    target = mx.float32 if dtype == "float32" else mx.float16
    route = f"dequantized to {dtype}" if quantized else f"stored as {dtype}"
    return Converted({"weight": values.astype(target)}, shape, None, route)


def _decode(raw: np.ndarray, kind: Q, shape: tuple[int, ...]) -> mx.array:
    if kind == Q.F32:
        return mx.array(raw.view(np.float32).reshape(shape))
    if kind == Q.F16:  # float16 -> float32 in MLX: exact, and faster than numpy
        return mx.array(raw.view(np.float16).reshape(shape)).astype(mx.float32)
    return mx.array(dequantize(raw, kind).reshape(shape))


def _requantize(values: mx.array, bits: int, shape: tuple[int, ...]) -> Converted:
    weight, scales, biases = mx.quantize(values, group_size=GROUP_SIZE, bits=bits)
    arrays = {"weight": weight, "scales": scales.astype(mx.float16)}
    arrays["biases"] = biases.astype(mx.float16)
    route = f"requantized to MLX {bits}-bit affine, group {GROUP_SIZE}"
    return Converted(arrays, shape, bits, route)


# -- exact repacking -----------------------------------------------------------
# Each returns (codes 0..2^bits-1, scale, bias) per block so that
# value = scale * code + bias; the layouts mirror gguf.quants' decoders.

_Codes = tuple[np.ndarray, np.ndarray, np.ndarray]


def _f16(column: np.ndarray) -> np.ndarray:
    return column.copy().view(np.float16).astype(np.float32)


def _nibbles_q4_0(qs: np.ndarray) -> np.ndarray:
    # Byte j holds element j (low nibble) and element j + 16 (high nibble).
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(blocks: np.ndarray) -> _Codes:
    d = _f16(blocks[:, :2])
    codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128 * d


def _q4_0(blocks: np.ndarray) -> _Codes:
    d = _f16(blocks[:, :2])
    return _nibbles_q4_0(blocks[:, 2:]), d, -8 * d


def _q4_1(blocks: np.ndarray) -> _Codes:
    return _nibbles_q4_0(blocks[:, 4:]), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per-32 scale and bias from the super-block's d, dmin and 6-bit codes."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])
    return d * sc.astype(np.float32), -dmin * mins.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    # 64-element chunks: byte j of a 32-byte run holds elements j and j + 32.
    n = qs.shape[0]
    shifted = qs.reshape(n, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (shifted & 0x0F).reshape(n, -1)


def _q4_k(blocks: np.ndarray) -> _Codes:
    return (_k_low_nibbles(blocks[:, 16:]), *_k_scales(blocks))


def _q5_k(blocks: np.ndarray) -> _Codes:
    n = blocks.shape[0]
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = _k_low_nibbles(blocks[:, 48:]) | ((qh & 1).reshape(n, -1) << 4)
    return (codes, *_k_scales(blocks))


_EXACT: dict[Q, tuple[int, Callable[[np.ndarray], _Codes]]] = {
    Q.Q8_0: (8, _q8_0),
    Q.Q4_0: (4, _q4_0),
    Q.Q4_1: (4, _q4_1),
    Q.Q4_K: (4, _q4_k),
    Q.Q5_K: (5, _q5_k),
}


def _exact(data: np.ndarray, kind: Q, shape: tuple[int, ...]) -> Converted:
    bits, split = _EXACT[kind]
    rows, cols = shape
    codes, scales, biases = split(np.asarray(data).reshape(-1, GGML_QUANT_SIZES[kind][1]))
    arrays = {
        "weight": mx.array(pack_codes(codes.reshape(rows, cols), bits)),
        "scales": mx.array(scales.reshape(rows, -1).astype(np.float16)),
        "biases": mx.array(biases.reshape(rows, -1).astype(np.float16)),
    }
    route = f"kept as MLX {bits}-bit affine, group {GROUP_SIZE} (exact)"
    return Converted(arrays, shape, bits, route)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing: each row's codes as one little-endian bit stream, read as uint32."""
    rows = codes.shape[0]
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8).view(np.uint32)
    if bits == 4:
        pairs = codes.reshape(rows, -1, 2).astype(np.uint8)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)).view(np.uint32)
    stream = np.unpackbits(codes.astype(np.uint8)[..., None], axis=-1, bitorder="little")
    packed = np.packbits(stream[..., :bits].reshape(rows, -1), axis=-1, bitorder="little")
    return packed.view(np.uint32)
