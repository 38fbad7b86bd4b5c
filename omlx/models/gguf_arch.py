"""Per-architecture mapping from a GGUF (llama.cpp's names) to an mlx-lm model.

For each ``general.architecture`` this says which mlx-lm model type it is,
how llama.cpp's tensor names map to mlx-lm's parameter names, and how the
``<arch>.*`` metadata becomes config.json. The mappings mirror what llama.cpp's
convert_hf_to_gguf.py does to each architecture, inverted.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from omlx.errors import ImportFailedError
from omlx.models.gguf_reader import GGUFHeader, as_float, as_int, as_str

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LLAMA_LAYER = {
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
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 2/3 norm around both attention and MLP; llama.cpp's ffn_norm is the pre-MLP one.
_GEMMA2_LAYER = {
    **_LLAMA_LAYER,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # llama.cpp keeps Phi-3's fused gate+up as ffn_up
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors that hold configuration rather than weights (see config_from_tensors).
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)")
PARAMS = ("weight", "bias")


class Meta:
    """Typed access to a GGUF's ``<arch>.<key>`` metadata."""

    def __init__(self, metadata: dict[str, Any], arch: str):
        self.metadata, self.prefix = metadata, f"{arch}."

    def has(self, key: str) -> bool:
        return self.prefix + key in self.metadata

    def raw(self, key: str, default: Any = None) -> Any:
        if default is None and not self.has(key):
            raise ImportFailedError(
                f"the GGUF has no {self.prefix}{key}: it is not a complete {self.prefix[:-1]} model"
            )
        return self.metadata.get(self.prefix + key, default)

    def int(self, key: str, default: int | None = None, *, low: int = 1) -> int:
        return as_int(self.prefix + key, self.raw(key, default), low=low)

    def float(self, key: str, default: float | None = None) -> float:
        return as_float(self.prefix + key, self.raw(key, default))


@dataclass(frozen=True, slots=True)
class Arch:
    model_type: str
    hf_class: str  # config.json "architectures", for tools that read it
    layer_names: dict[str, str]
    norm_shift: float = 0.0  # llama.cpp stores Gemma's RMSNorm weights + 1
    rope_traditional: bool = False  # llama.cpp permutes llama q/k rows for interleaved RoPE
    partial_rope: bool = False
    extra: Callable[[Meta, dict[str, Any]], dict[str, Any]] = field(default=lambda m, c: {})

    def mlx_name(self, gguf_name: str) -> str:
        """llama.cpp tensor name -> mlx-lm parameter name, e.g. blk.3.attn_q.weight."""
        base, _, param = gguf_name.rpartition(".")
        if param in PARAMS:
            if base in _TOP_LEVEL:
                return f"{_TOP_LEVEL[base]}.{param}"
            match = _LAYER_NAME.fullmatch(base)
            if match and match.group(2) in self.layer_names:
                part = self.layer_names[match.group(2)]
                return f"model.layers.{match.group(1)}.{part}.{param}"
        raise ImportFailedError(
            f"tensor {gguf_name} has no counterpart in mlx-lm's {self.model_type} model"
        )


def _attention_scale(config: dict[str, Any], large_layers: int) -> int:
    # As llama.cpp: the 27B Gemma 2/3 scale queries by hidden/heads, the others by
    # head_dim. An int: transformers' Gemma configs (read by mlx-lm's load) insist.
    if config["num_hidden_layers"] == large_layers:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return int(config["head_dim"])


def _gemma2(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "attn_logit_softcapping": meta.float("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": meta.float("final_logit_softcapping", 30.0),
        "query_pre_attn_scalar": _attention_scale(config, 46),
    }


def _gemma3(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "rope_theta": meta.float("rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": 10_000.0,  # llama.cpp hard-codes it for Gemma 3
        "sliding_window": meta.int("attention.sliding_window", 512),
        "sliding_window_pattern": _sliding_window_pattern(meta),
        "query_pre_attn_scalar": _attention_scale(config, 62),
    }


def _sliding_window_pattern(meta: Meta) -> int:
    # Newer files store it (an int, or one bool per layer: sliding or not); older
    # ones rely on llama.cpp's built-in 6 (five sliding layers, then a global one).
    value = meta.raw("attention.sliding_window_pattern", 6)
    if isinstance(value, int) and not isinstance(value, bool):
        return as_int(meta.prefix + "attention.sliding_window_pattern", value, low=1)
    flags = list(value) if hasattr(value, "__len__") else []
    if False in flags:
        return flags.index(False) + 1
    raise ImportFailedError(f"{meta.prefix}attention.sliding_window_pattern is not understood")


def _phi3(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    # LongRoPE's switch point; the factors themselves are tensors (config_from_tensors).
    original = meta.int("rope.scaling.original_context_length", 4096)
    return {"original_max_position_embeddings": original}


ARCHITECTURES = {
    "llama": Arch("llama", "LlamaForCausalLM", _LLAMA_LAYER, rope_traditional=True),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", _LLAMA_LAYER),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", {**_LLAMA_LAYER, **_QK_NORM}),
    "gemma": Arch("gemma", "GemmaForCausalLM", _LLAMA_LAYER, norm_shift=1.0),
    "gemma2": Arch("gemma2", "Gemma2ForCausalLM", _GEMMA2_LAYER, norm_shift=1.0, extra=_gemma2),
    "gemma3": Arch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        {**_GEMMA2_LAYER, **_QK_NORM},
        norm_shift=1.0,
        extra=_gemma3,
    ),
    "phi3": Arch("phi3", "Phi3ForCausalLM", _PHI3_LAYER, partial_rope=True, extra=_phi3),
}


def architecture(header: GGUFHeader) -> tuple[str, Arch]:
    name = header.metadata.get("general.architecture")
    if not isinstance(name, str) or name not in ARCHITECTURES:
        shown = repr(name) if isinstance(name, str | None) else "(not a string)"
        raise ImportFailedError(
            f"architecture {shown} is not supported: GGUF files of "
            f"{', '.join(ARCHITECTURES)} can be imported (Mistral's are 'llama')"
        )
    return name, ARCHITECTURES[name]


def build_config(header: GGUFHeader) -> dict[str, Any]:
    """mlx-lm config.json from the GGUF's ``<arch>.*`` metadata."""
    name, arch = architecture(header)
    meta = Meta(header.metadata, name)
    if meta.int("expert_count", 0, low=0) > 0:
        raise ImportFailedError(f"mixture-of-experts {name} models are not supported")
    hidden = meta.int("embedding_length")
    heads = meta.int("attention.head_count")
    head_dim = meta.int("attention.key_length", hidden // heads)
    config = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": _block_count(header, meta),
        "intermediate_size": meta.int("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.int("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.float("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.float("rope.freq_base", 10000.0),
        "rope_traditional": arch.rope_traditional,
        "max_position_embeddings": meta.int("context_length", 2048),
        "vocab_size": _vocab_size(header),
    }
    config.update(_rope_dims(meta, arch, head_dim))
    if scaling := _rope_scaling(meta):
        config["rope_scaling"] = scaling
    config.update(arch.extra(meta, config))
    return config


def _rope_dims(meta: Meta, arch: Arch, head_dim: int) -> dict[str, Any]:
    rope_dims = meta.int("rope.dimension_count", head_dim)
    if rope_dims == head_dim:
        return {}
    if arch.partial_rope and rope_dims < head_dim:
        return {"partial_rotary_factor": rope_dims / head_dim}
    raise ImportFailedError(
        f"{meta.prefix}rope.dimension_count is {rope_dims} but head_dim is {head_dim}: "
        f"partial RoPE is not supported for {arch.model_type}"
    )


def _block_count(header: GGUFHeader, meta: Meta) -> int:
    # Every layer has several tensors, so the table bounds the count.
    count = meta.int("block_count")
    if count > len(header.tensors):
        raise ImportFailedError(
            f"{meta.prefix}block_count is {count}, but the file has only "
            f"{len(header.tensors)} tensors"
        )
    return count


def _vocab_size(header: GGUFHeader) -> int:
    # The embedding's rows are authoritative: <arch>.vocab_size is optional.
    for tensor in header.tensors:
        if tensor.name == "token_embd.weight":
            if len(tensor.shape) != 2:
                raise ImportFailedError(
                    f"token_embd.weight must be 2-D, not of shape {list(tensor.shape)}"
                )
            return tensor.shape[0]
    raise ImportFailedError("the GGUF has no token_embd.weight tensor")


def _rope_scaling(meta: Meta) -> dict[str, Any] | None:
    key = meta.prefix + "rope.scaling.type"
    kind = as_str(key, meta.metadata.get(key, "none"))
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": meta.float("rope.scaling.factor")}
    raise ImportFailedError(f"RoPE scaling {kind!r} is not supported (only none and linear)")


def expected_parameters(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter mlx-lm's model for ``config`` has.

    Building the model is cheap: MLX arrays are lazy, so no weights are allocated.
    """
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    try:
        model = module.Model(module.ModelArgs.from_dict(config))
    except (ValueError, TypeError, KeyError) as exc:
        raise ImportFailedError(f"mlx-lm rejects the GGUF's configuration: {exc}") from exc
    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return {name: tuple(array.shape) for name, array in flat}


def config_from_tensors(values: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, Any]:
    """Config entries llama.cpp stored as tensors: Llama 3.1+'s RoPE scaling
    (rope_freqs) and Phi-3's LongRoPE factors (rope_factors_long/short)."""
    owner = {"rope_freqs.weight": "llama", "rope_factors_long.weight": "phi3"}
    for name, model_type in owner.items():
        if name in values and config["model_type"] != model_type:
            raise ImportFailedError(f"{name} is not supported for {config['model_type']}")
    if "rope_freqs.weight" in values:
        return {"rope_scaling": _llama3_rope_scaling(values["rope_freqs.weight"], config)}
    if "rope_factors_long.weight" in values:
        long = values["rope_factors_long.weight"].reshape(-1).tolist()
        short = values.get("rope_factors_short.weight", np.ones(len(long))).reshape(-1).tolist()
        return {"rope_scaling": {"type": "longrope", "long_factor": long, "short_factor": short}}
    return {}


def _llama3_rope_scaling(factors: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    """The llama3 rope_scaling whose per-frequency factors are ``factors``.

    llama.cpp keeps only the factors; its converter computes them from factor,
    low/high_freq_factor and the original context. Meta's releases all use 1, 4
    and 8192 (3.1: factor 8, 3.2: 32), so those are tried and the result is
    checked against every stored factor: a file that differs is refused.
    """
    dims = config["head_dim"]
    periods = config["rope_theta"] ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape != periods.shape:
        raise ImportFailedError(f"rope_freqs.weight has {factors.size} values, not {dims // 2}")
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_factors(periods, scaling), factors, rtol=1e-4):
        raise ImportFailedError(
            "rope_freqs.weight is not Llama 3's RoPE scaling with factor "
            f"{scaling['factor']}, frequency factors 1 and 4 and an original context of 8192"
        )
    return scaling


def _llama3_factors(periods: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, vectorized.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelens = 2 * np.pi * periods
    smooth = (context / wavelens - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelens < context / high, 1.0, np.where(wavelens > context / low, factor, medium)
    )
