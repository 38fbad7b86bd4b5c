"""Convert a GGUF file (llama, Mistral, Qwen 2/3, Gemma 1/2/3, Phi-3) into an mlx-lm folder.

The header is validated by gguf_reader, each tensor is memory-mapped and
decoded by llama.cpp's gguf-py or repacked (gguf_tensors), the names and the
config come from gguf_arch, and the tokenizer from gguf_tokenizer. llama.cpp
stores llama q/k rows permuted for interleaved RoPE, so the folder keeps them
as they are and sets ``rope_traditional``.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

import mlx.core as mx
import numpy as np

from omlx.errors import ImportFailedError
from omlx.models.gguf_arch import (
    CONFIG_TENSORS,
    Arch,
    architecture,
    build_config,
    config_from_tensors,
    expected_parameters,
)
from omlx.models.gguf_reader import GGUFHeader, read_header
from omlx.models.gguf_tensors import GROUP_SIZE, DType, convert_tensor, iter_tensors
from omlx.models.gguf_tokenizer import ImportedTokenizer, build_tokenizer

__all__ = ["DType", "ImportResult", "build_config", "convert_gguf", "import_gguf"]

log = logging.getLogger(__name__)

_SHARD_BYTES = 5 << 30  # mlx-lm's own shard size


@dataclass(frozen=True, slots=True)
class ImportResult:
    path: Path
    architecture: str  # general.architecture
    model_type: str  # mlx-lm's
    dtype: str
    # GGUF tensor type -> {"tensors": how many, "became": what the import made of them}
    tensor_types: dict[str, dict[str, Any]]
    gguf_bytes: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


def import_gguf(
    gguf_path: Path, out_dir: Path, *, dtype: DType = "float32", overwrite: bool = False
) -> Path:
    """Convert ``gguf_path`` into an mlx-lm folder at ``out_dir`` and return ``out_dir``."""
    return convert_gguf(gguf_path, out_dir, dtype=dtype, overwrite=overwrite).path


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, dtype: DType = "float32", overwrite: bool = False
) -> ImportResult:
    """Convert ``gguf_path`` into an mlx-lm folder at ``out_dir``; say what became of each type.

    ``dtype`` "float32" / "float16" dequantizes every tensor; "keep" keeps
    quantized tensors quantized (see gguf_tensors for which are exact and which
    are requantized). The folder appears whole or not at all: it is written
    into a hidden temp folder beside ``out_dir`` and renamed into place. Every
    failure raises ImportFailedError saying why.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in get_args(DType):
        raise ImportFailedError(f"dtype must be one of {', '.join(get_args(DType))}, not {dtype!r}")
    if out_dir.exists() and not overwrite:
        raise ImportFailedError(f"{out_dir} already exists (pass overwrite=True to replace it)")
    start = time.perf_counter()
    header = read_header(gguf_path)
    arch_name, arch = architecture(header)
    config = build_config(header)
    tokenizer = build_tokenizer(
        header.metadata, model_max_length=config["max_position_embeddings"], arch=arch_name
    )
    config.update(config_from_tensors(_config_tensors(gguf_path, header), config))
    weights, shapes, bits, routes = load_weights(gguf_path, header, arch, dtype)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    check_parameters(shapes, config)
    if quantization := _quantization(bits):
        # mlx-lm reads "quantization"; HF-style tools read "quantization_config".
        config["quantization"] = config["quantization_config"] = quantization
    config.update(_token_ids(tokenizer))
    _write_folder(out_dir, weights, config, tokenizer, overwrite=overwrite)
    seconds = time.perf_counter() - start
    log.info("imported %s -> %s (%s) in %.2f s", gguf_path.name, out_dir, dtype, seconds)
    types = {kind: {"tensors": n, "became": route} for (kind, route), n in sorted(routes.items())}
    size = gguf_path.stat().st_size
    return ImportResult(out_dir, arch_name, arch.model_type, dtype, types, size, seconds)


_Routes = Counter[tuple[str, str]]  # (GGUF type, what became of it) -> tensors
_Loaded = tuple[dict[str, mx.array], dict[str, tuple[int, ...]], dict[str, int], _Routes]


def load_weights(path: Path, header: GGUFHeader, arch: Arch, dtype: DType) -> _Loaded:
    """mlx-lm-named arrays, each parameter's logical shape, the bits of each
    quantized module, and a count of (GGUF type, route) pairs."""
    weights: dict[str, mx.array] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    bits: dict[str, int] = {}
    routes: _Routes = Counter()
    tensors = [info for info in header.tensors if info.name not in CONFIG_TENSORS]
    names = {info.name: arch.mlx_name(info.name) for info in tensors}  # fail fast
    for info, raw in iter_tensors(path, tensors):
        name = names[info.name]
        shift = arch.norm_shift if info.name.endswith("norm.weight") else 0.0
        converted = convert_tensor(info, raw, dtype, offset=-shift)
        module = name.rpartition(".")[0]
        for param, array in converted.arrays.items():
            weights[name if param == "weight" else f"{module}.{param}"] = array
        if converted.bits is not None:
            bits[module] = converted.bits
        shapes[name] = converted.shape
        routes[(info.type_name, converted.route)] += 1
        mx.eval(list(converted.arrays.values()))  # one tensor's decode buffers at a time
    return weights, shapes, bits, routes


def _config_tensors(path: Path, header: GGUFHeader) -> dict[str, np.ndarray]:
    infos = [info for info in header.tensors if info.name in CONFIG_TENSORS]
    return {
        info.name: np.array(convert_tensor(info, raw, "float32").arrays["weight"])
        for info, raw in iter_tensors(path, infos)
    }


def check_parameters(shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> None:
    """The file's tensors are exactly mlx-lm's parameters for ``config``, shapes included."""
    expected = expected_parameters(config)
    if config["tie_word_embeddings"]:  # models that always build lm_head drop it when tied
        expected.pop("lm_head.weight", None)
    if missing := sorted(expected.keys() - shapes.keys()):
        raise ImportFailedError(f"the GGUF lacks {len(missing)} tensors, e.g. {missing[0]}")
    if extra := sorted(shapes.keys() - expected.keys()):
        raise ImportFailedError(
            f"the GGUF has {len(extra)} tensors mlx-lm's {config['model_type']} model "
            f"for this config does not have, e.g. {extra[0]} (beyond block_count?)"
        )
    for name, shape in sorted(shapes.items()):
        if shape != expected[name]:
            raise ImportFailedError(
                f"tensor {name} has shape {list(shape)}, but the config's model "
                f"expects {list(expected[name])}"
            )


def _quantization(bits: dict[str, int]) -> dict[str, Any] | None:
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default}
    for module, num_bits in sorted(bits.items()):
        if num_bits != default:
            config[module] = {"group_size": GROUP_SIZE, "bits": num_bits}
    return config


def _token_ids(tokenizer: ImportedTokenizer) -> dict[str, Any]:
    ids: dict[str, Any] = {}
    if tokenizer.bos_token_id is not None:
        ids["bos_token_id"] = tokenizer.bos_token_id
    eos = tokenizer.eos_token_ids
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids


def _write_folder(
    out_dir: Path,
    weights: dict[str, mx.array],
    config: dict[str, Any],
    tokenizer: ImportedTokenizer,
    *,
    overwrite: bool,
) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Hidden (leading ".") so model discovery never sees a half-written folder.
    tmp = out_dir.with_name(f".{out_dir.name}.importing-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        _save_weights(tmp, weights)
        tokenizer.save(tmp)
        _write_json(tmp / "generation_config.json", _token_ids(tokenizer))
        _write_json(tmp / "config.json", dict(sorted(config.items())))
        _move_into_place(tmp, out_dir, overwrite=overwrite)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ImportFailedError(f"cannot write the model into {out_dir}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_weights(folder: Path, weights: dict[str, mx.array]) -> None:
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name in sorted(weights):
        array = weights[name]
        if shards[-1] and size + array.nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), shards[0], {"format": "mlx"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(folder / file_name), shard, {"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(a.nbytes for a in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(folder / "model.safetensors.index.json", index)


def _move_into_place(tmp: Path, out_dir: Path, *, overwrite: bool) -> None:
    old = None
    try:
        if out_dir.exists():
            if not overwrite:
                raise ImportFailedError(f"{out_dir} appeared while importing; not replaced")
            old = out_dir.with_name(f".{out_dir.name}.replaced-{uuid.uuid4().hex[:8]}")
            out_dir.rename(old)
        tmp.rename(out_dir)
    except OSError as exc:
        if old is not None and not out_dir.exists():
            old.rename(out_dir)  # put the previous folder back
        raise ImportFailedError(f"cannot move the imported model into {out_dir}: {exc}") from exc
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
