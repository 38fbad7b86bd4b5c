"""Convert a llama-architecture GGUF file into an mlx-lm model folder.

``mx.load`` reads the tensors: Q4_0 / Q4_1 / Q8_0 come back as MLX affine
triples (weight, scales, biases) with group size 32, everything else as float.
llama.cpp stores q/k rows permuted for interleaved RoPE, so the folder keeps
them as they are and sets ``rope_traditional``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Literal, get_args

import mlx.core as mx

from omlx.errors import ImportFailedError
from omlx.models.gguf_reader import GGUFHeader, as_float, as_int, as_str, read_header
from omlx.models.gguf_tokenizer import ImportedTokenizer, build_tokenizer

log = logging.getLogger(__name__)

DType = Literal["float32", "float16", "keep"]
GROUP_SIZE = 32  # every GGUF block format mx.load unpacks uses blocks of 32
_SHARD_BYTES = 5 << 30  # mlx-lm's own shard size

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)")
_PARAMS = ("weight", "scales", "biases")
_QUANT = (".scales", ".biases")


def import_gguf(
    gguf_path: Path, out_dir: Path, *, dtype: DType = "float32", overwrite: bool = False
) -> Path:
    """Convert ``gguf_path`` into an mlx-lm folder at ``out_dir`` and return ``out_dir``.

    ``dtype`` "float32" / "float16" dequantizes every tensor; "keep" keeps the
    GGUF's quantized tensors as MLX quantized weights. The folder appears whole
    or not at all: it is written into a hidden temp folder beside ``out_dir``
    and renamed into place. Every failure raises ImportFailedError saying why.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in get_args(DType):
        raise ImportFailedError(f"dtype must be one of {', '.join(get_args(DType))}, not {dtype!r}")
    if out_dir.exists() and not overwrite:
        raise ImportFailedError(f"{out_dir} already exists (pass overwrite=True to replace it)")
    start = time.perf_counter()
    header = read_header(gguf_path)
    config = build_config(header)
    tokenizer = build_tokenizer(header.metadata, model_max_length=config["max_position_embeddings"])
    weights, quantization = convert_weights(_load_tensors(gguf_path, header), dtype)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    _check_complete(weights, config)
    if quantization:
        # mlx-lm reads "quantization"; HF-style tools read "quantization_config".
        config["quantization"] = config["quantization_config"] = quantization
    config.update(_token_ids(tokenizer))
    _write_folder(out_dir, weights, config, tokenizer, overwrite=overwrite)
    elapsed_s = time.perf_counter() - start
    log.info("imported %s -> %s (%s) in %.2f s", gguf_path.name, out_dir, dtype, elapsed_s)
    return out_dir


def build_config(header: GGUFHeader) -> dict[str, Any]:
    """mlx-lm llama config.json from the GGUF's ``llama.*`` metadata."""
    meta = header.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch != "llama":
        shown = repr(arch) if isinstance(arch, str | None) else "(not a string)"
        raise ImportFailedError(
            f"architecture {shown} is not supported: only 'llama' GGUF files can be imported"
        )
    if _int(meta, "expert_count", 0, low=0) > 0:
        raise ImportFailedError("mixture-of-experts llama models (Mixtral) are not supported")
    hidden = _int(meta, "embedding_length")
    heads = _int(meta, "attention.head_count")
    head_dim = _int(meta, "attention.key_length", hidden // heads)
    if _int(meta, "rope.dimension_count", head_dim) != head_dim:
        raise ImportFailedError("partial RoPE (rope.dimension_count < head_dim) is not supported")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": _block_count(header),
        "intermediate_size": _int(meta, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(meta, "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float(meta, "attention.layer_norm_rms_epsilon"),
        "rope_theta": _float(meta, "rope.freq_base", 10000.0),
        "rope_traditional": True,  # llama.cpp interleaves q/k rows for GPT-J style RoPE
        "max_position_embeddings": _int(meta, "context_length", 2048),
        "vocab_size": _vocab_size(header),
    }
    if scaling := _rope_scaling(meta):
        config["rope_scaling"] = scaling
    return config


_LLAMA = "llama."


def _llama(meta: dict[str, Any], key: str) -> Any:
    if f"llama.{key}" not in meta:
        raise ImportFailedError(f"the GGUF has no llama.{key}: it is not a complete llama model")
    return meta[f"llama.{key}"]


def _int(meta: dict[str, Any], key: str, default: int | None = None, *, low: int = 1) -> int:
    """``llama.<key>`` as an int of at least ``low``; required when ``default`` is None."""
    value = _llama(meta, key) if default is None else meta.get(_LLAMA + key, default)
    return as_int(_LLAMA + key, value, low=low)


def _float(meta: dict[str, Any], key: str, default: float | None = None) -> float:
    value = _llama(meta, key) if default is None else meta.get(_LLAMA + key, default)
    return as_float(_LLAMA + key, value)


def _block_count(header: GGUFHeader) -> int:
    # Every layer has nine tensors, so the table bounds the count.
    count = _int(header.metadata, "block_count")
    if count > len(header.tensors):
        raise ImportFailedError(
            f"llama.block_count is {count}, but the file has only {len(header.tensors)} tensors"
        )
    return count


def _vocab_size(header: GGUFHeader) -> int:
    # The embedding's rows are authoritative: llama.vocab_size is optional.
    for tensor in header.tensors:
        if tensor.name == "token_embd.weight":
            if len(tensor.shape) != 2:
                raise ImportFailedError(
                    f"token_embd.weight must be 2-D, not of shape {list(tensor.shape)}"
                )
            return tensor.shape[0]
    raise ImportFailedError("the GGUF has no token_embd.weight tensor")


def _rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = as_str(_LLAMA + "rope.scaling.type", meta.get(_LLAMA + "rope.scaling.type", "none"))
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": _float(meta, "rope.scaling.factor")}
    raise ImportFailedError(f"RoPE scaling {kind!r} is not supported (only none and linear)")


def _load_tensors(path: Path, header: GGUFHeader) -> dict[str, mx.array]:
    try:
        arrays = mx.load(str(path), format="gguf")
    except (RuntimeError, ValueError) as exc:
        raise ImportFailedError(f"mlx cannot read the tensors of {path.name}: {exc}") from exc
    assert isinstance(arrays, dict)
    # mx.load drops every tensor after one it cannot decode, without an error.
    missing = [t.name for t in header.tensors if t.name not in arrays]
    if missing:
        raise ImportFailedError(f"mlx could not read {len(missing)} tensors, e.g. {missing[0]}")
    return arrays


def mlx_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> mlx-lm parameter name, e.g. blk.3.attn_q.weight."""
    base, _, param = gguf_name.rpartition(".")
    if param in _PARAMS:
        if base in _TOP_LEVEL:
            return f"{_TOP_LEVEL[base]}.{param}"
        match = _LAYER_NAME.fullmatch(base)
        if match and match.group(2) in _PER_LAYER:
            return f"model.layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}.{param}"
    raise ImportFailedError(f"tensor {gguf_name} has no counterpart in mlx-lm's llama model")


def convert_weights(
    arrays: dict[str, mx.array], dtype: DType
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename to mlx-lm names and dequantize (or keep) quantized triples.

    Returns the weights and, for "keep" with quantized tensors, the config's
    "quantization" entry (per-module entries where bits differ from the default).
    """
    weights = {mlx_name(name): array for name, array in arrays.items()}
    bits = {
        name.removesuffix(".scales"): _bits(weights, name.removesuffix(".scales"))
        for name in weights
        if name.endswith(".scales")
    }
    if dtype == "keep":
        return weights, _quantization(bits)
    target = mx.float32 if dtype == "float32" else mx.float16
    for module, num_bits in bits.items():
        weights[f"{module}.weight"] = _dequantize(weights, module, num_bits)
    return {k: v.astype(target) for k, v in weights.items() if not k.endswith(_QUANT)}, None


def _bits(weights: dict[str, mx.array], module: str) -> int:
    packed, scales = weights[f"{module}.weight"], weights[f"{module}.scales"]
    return packed.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)


def _dequantize(weights: dict[str, mx.array], module: str, bits: int) -> mx.array:
    # Scales and biases are float16; dequantizing in float32 avoids a second rounding.
    return mx.dequantize(
        weights[f"{module}.weight"],
        weights[f"{module}.scales"].astype(mx.float32),
        weights[f"{module}.biases"].astype(mx.float32),
        group_size=GROUP_SIZE,
        bits=bits,
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


def _check_complete(weights: dict[str, mx.array], config: dict[str, Any]) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{part}.weight" for part in _PER_LAYER.values()}
    found = {name for name in weights if name.endswith(".weight")}
    if missing := sorted(expected - found):
        raise ImportFailedError(f"the GGUF lacks {len(missing)} tensors, e.g. {missing[0]}")
    if extra := sorted(found - expected):
        raise ImportFailedError(
            f"the GGUF has {len(extra)} tensors beyond llama.block_count, e.g. {extra[0]}"
        )


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
