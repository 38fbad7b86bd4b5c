"""What the import makes of each GGUF tensor type, checked against llama.cpp's decoding.

Each case writes a real one-tensor GGUF (gguf-py's writer; K-quant and IQ4_NL
blocks from tests/fixtures/gguf_files.py), reads it back through the import's
own reader, and compares with ``gguf.quants.dequantize`` (llama.cpp's reference).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx.models.gguf_reader import read_header
from omlx.models.gguf_tensors import REQUANT_BITS, convert_tensor, iter_tensors
from tests.fixtures.gguf_files import decode, quantize

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

EXACT = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K]
REQUANTIZED = [Q.Q2_K, Q.Q3_K, Q.Q6_K, Q.IQ4_NL, Q.Q5_0, Q.Q5_1, Q.MXFP4]
ROWS, COLS = 24, 512


def weights(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)


def one_tensor_gguf(path: Path, blocks: np.ndarray, kind: Q) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def convert(path: Path, dtype: str):
    [(info, raw)] = iter_tensors(path, read_header(path).tensors)
    return convert_tensor(info, raw, dtype)


def dequantized(converted) -> np.ndarray:
    arrays = converted.arrays
    if converted.bits is None:
        return np.array(arrays["weight"].astype(mx.float32))
    # In float32: mx.dequantize returns the scales' dtype, and float16 output would round.
    scales, biases = arrays["scales"].astype(mx.float32), arrays["biases"].astype(mx.float32)
    values = mx.dequantize(arrays["weight"], scales, biases, group_size=32, bits=converted.bits)
    return np.array(values)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt((x**2).mean()))


@pytest.mark.parametrize("kind", EXACT + REQUANTIZED, ids=lambda k: k.name)
def test_float32_is_llama_cpp_decoding(tmp_path: Path, kind: Q) -> None:
    blocks = quantize(weights(), kind)
    converted = convert(one_tensor_gguf(tmp_path / "t.gguf", blocks, kind), "float32")
    assert converted.route == "dequantized to float32" and converted.shape == (ROWS, COLS)
    np.testing.assert_array_equal(dequantized(converted), decode(blocks, kind).reshape(ROWS, COLS))


@pytest.mark.parametrize("kind", EXACT, ids=lambda k: k.name)
def test_keep_repacks_affine_types_exactly(tmp_path: Path, kind: Q) -> None:
    blocks = quantize(weights(), kind)
    converted = convert(one_tensor_gguf(tmp_path / "t.gguf", blocks, kind), "keep")
    expected = decode(blocks, kind).reshape(ROWS, COLS)

    assert (
        converted.route.endswith("group 32 (exact)")
        and converted.arrays["weight"].dtype == mx.uint32
    )
    # Exact but for rounding the K-quants' products d*sc and dmin*m to float16 (half
    # a float16 ulp each: under 2^-10 of the largest weight); the legacy types are exact.
    error = np.abs(dequantized(converted) - expected).max()
    bound = 2**-10 * np.abs(expected).max() if kind in (Q.Q4_K, Q.Q5_K) else 0.0
    assert error <= bound, error


@pytest.mark.parametrize("kind", REQUANTIZED, ids=lambda k: k.name)
def test_keep_requantizes_other_types_within_a_third_of_their_error(
    tmp_path: Path, kind: Q
) -> None:
    original = weights()
    blocks = quantize(original, kind)
    converted = convert(one_tensor_gguf(tmp_path / "t.gguf", blocks, kind), "keep")
    decoded = decode(blocks, kind).reshape(ROWS, COLS)

    assert converted.bits == REQUANT_BITS[kind]
    assert converted.route == f"requantized to MLX {converted.bits}-bit affine, group 32"
    # Two more bits than the source: MLX's step is ~1/4 of the source's.
    added = rms(dequantized(converted) - decoded)
    assert added < rms(decoded - original) / 3, (added, rms(decoded - original))


def test_iq_types_llama_cpp_decodes_are_imported(tmp_path: Path) -> None:
    # gguf-py cannot write IQ2_XXS; any block bytes are a valid encoding, so random
    # ones (with a sane float16 scale) stand in for a real file's.
    rng = np.random.default_rng(1)
    block, block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
    blocks = rng.integers(0, 256, (ROWS, COLS // block * block_bytes), dtype=np.uint8)
    scales = np.full((ROWS, COLS // block), 0.01, np.float16).view(np.uint8)
    blocks.reshape(ROWS, -1, block_bytes)[:, :, :2] = scales.reshape(ROWS, -1, 2)
    path = one_tensor_gguf(tmp_path / "iq.gguf", blocks, Q.IQ2_XXS)

    expected = decode(blocks, Q.IQ2_XXS).reshape(ROWS, COLS)
    np.testing.assert_array_equal(dequantized(convert(path, "float32")), expected)
    kept = convert(path, "keep")
    # IQ2 keeps roughly half the signal; MLX's 4 bits add about a tenth of it.
    assert kept.bits == 4 and rms(dequantized(kept) - expected) < 0.15 * rms(expected)
