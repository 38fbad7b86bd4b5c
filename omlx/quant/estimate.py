"""What an oQ job will take and make, from the source's headers alone. Pure: no mlx."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omlx.cache.safetensors_io import DTYPE_SIZES, SafetensorsFormatError, read_header
from omlx.errors import InvalidRequestError, ModelLoadError
from omlx.quant.levels import check_group_size, get_level

_FLOAT_DTYPES = {"F32", "F16", "BF16"}
# Python, MLX and tokenizer overhead of the job's process, above the tensors.
JOB_OVERHEAD_BYTES = 384 * 1024 * 1024
# Tokens per forward pass in the job (its logits dominate the activations).
CHUNK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Estimate:
    model: str
    level: str
    group_size: int
    source_bytes: int
    estimated_bytes: int
    target_bits_per_weight: float
    estimated_memory_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def source_config(source: Path) -> dict[str, Any]:
    """The source's config.json; refuses a folder that is not a float model."""
    try:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {source / 'config.json'}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{source / 'config.json'} is not a JSON object")
    if "quantization" in config or "quantization_config" in config:
        raise InvalidRequestError(
            f"'{source.name}' is already quantized; oQ needs a float (unquantized) model",
            param="model",
        )
    return config


def _tensors(source: Path) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor in the folder's safetensors files."""
    out = []
    for path in sorted(source.glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                entries, _, _ = read_header(f, path.stat().st_size)
        except (OSError, SafetensorsFormatError) as exc:
            raise ModelLoadError(f"cannot read the weights in {path.name}: {exc}") from exc
        out += [(name, e["dtype"], list(e["shape"])) for name, e in entries.items()]
    return out


def _quantizable(name: str, dtype: str, shape: list[int], group_size: int) -> bool:
    """What the job quantizes: float 2-D weights whose rows split into groups."""
    return (
        name.endswith(".weight")
        and dtype in _FLOAT_DTYPES
        and len(shape) == 2
        and shape[-1] % group_size == 0
    )


def estimate(model: str, source: Path, level_name: str, group_size: int) -> Estimate:
    level = get_level(level_name)
    check_group_size(group_size)
    config = source_config(source)
    source_bytes, kept_bytes, num_quantized, scale_bits = 0, 0, 0, 16
    for name, dtype, shape in _tensors(source):
        num = 1
        for dim in shape:
            num *= dim
        size = num * DTYPE_SIZES.get(dtype, 4)
        source_bytes += size
        if _quantizable(name, dtype, shape, group_size):
            num_quantized += num
            scale_bits = max(scale_bits, DTYPE_SIZES[dtype] * 8)
        else:
            kept_bytes += size
    target = level.target_bits_per_weight(group_size, scale_bits)
    estimated = kept_bytes + int(num_quantized * target / 8)
    vocab = int(config.get("vocab_size") or 0)
    logits = 2 * CHUNK_TOKENS * vocab * 4  # float32 logits and their loss
    return Estimate(
        model=model,
        level=level.name,
        group_size=group_size,
        source_bytes=source_bytes,
        estimated_bytes=estimated,
        target_bits_per_weight=round(target, 4),
        estimated_memory_bytes=source_bytes + estimated + logits + JOB_OVERHEAD_BYTES,
    )
