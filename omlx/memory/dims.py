"""A model's shape as far as prefill memory is concerned, read from its config.json.

Pure: no MLX. Split from budget.py, which prices prefill with these numbers.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ModelDims",
    "allocated_columns",
    "conservative_dims",
    "gated_delta_state_bytes",
    "guard_dims",
    "kv_quantized_start",
    "model_dims",
    "rank_share",
    "written_columns",
]

logger = logging.getLogger(__name__)

_LM_SUBCONFIGS = ("text_config", "language_config", "llm_config", "language_model")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "n_kv_heads")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
_HEAD_DIM_KEYS = ("head_dim",)


@dataclass(frozen=True)
class ModelDims:
    """The language model's shape, as far as prefill memory is concerned."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    hidden_size: int
    kv_dtype_bytes: int = 2  # bf16/fp16 on Metal; callers pass 4 for float32
    # A draft model's KV per token (speculative decoding): every request holds both.
    draft_kv_bytes_per_token: int = 0
    # What the model's cache grows by per token, measured at load
    # (engine/kv_measure.py): it wins over the config's figure (hybrids, MLA).
    measured_kv_bytes_per_token: int | None = None
    # A quantized KV cache with a quantized_kv_start (kv_quantized_start below): what a
    # token costs on top while held in full precision, and the most tokens held so.
    full_kv_bytes_per_token: int = 0
    full_kv_tokens: int = 0
    # A hybrid's fixed states per sequence (mlx-lm's ArraysCache layers: convolution,
    # gated-delta, SSM), measured at load (engine/kv_measure.py); 0 for attention only.
    # Every row holds them whatever its length: priced per row, beside its tokens.
    state_bytes_per_sequence: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        own = self.measured_kv_bytes_per_token
        if own is None:
            own = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes
        return own + self.draft_kv_bytes_per_token

    def kv_bytes(self, num_tokens: int) -> int:
        """What ``num_tokens`` KV tokens (of all the model's requests together) can hold:
        ``kv_bytes_per_token`` each, plus the full-precision copy of the ones a
        ``quantized_kv_start`` keeps (kv_quantized_start)."""
        full = self.full_kv_bytes_per_token * min(num_tokens, self.full_kv_tokens)
        return self.kv_bytes_per_token * num_tokens + full

    def state_bytes(self, num_rows: int) -> int:
        """The fixed states ``num_rows`` sequences hold beside their KV."""
        return self.state_bytes_per_sequence * num_rows

    @property
    def state_tokens_per_sequence(self) -> int:
        """A sequence's fixed states in KV tokens (rounded up): what a row costs the
        KV capacity (counted in tokens) beyond its own tokens."""
        if not self.state_bytes_per_sequence:
            return 0
        return -(-self.state_bytes_per_sequence // max(1, self.kv_bytes_per_token))


def quantized_kv_dims(dims: ModelDims, bits: int, group_size: int) -> ModelDims:
    """``dims`` whose KV per token is mlx-lm's ``QuantizedKVCache``'s: each key and value
    vector holds ``bits`` per element plus a scale and a bias (the KV dtype) per group."""
    groups = max(dims.head_dim // group_size, 1)
    per_vector = dims.head_dim * bits // 8 + 2 * groups * dims.kv_dtype_bytes
    per_token = 2 * dims.num_layers * dims.num_kv_heads * per_vector
    return dataclasses.replace(dims, measured_kv_bytes_per_token=per_token)


def kv_quantized_start(
    dims: ModelDims, full_bytes_per_token: int, start: int, *, rows: int, chunk_tokens: int
) -> ModelDims:
    """``dims`` (their KV per token the quantized one) for a cache that holds a
    sequence's first ``start`` tokens in full precision (``full_bytes_per_token`` each),
    then quantizes all of them (mlx-lm's ``quantized_kv_start``; engine/quantized_cache.py).

    An upper bound on what N tokens hold at any moment: Q x N + F x min(N, rows x
    (start - 1 + chunk_tokens)), Q and F a token's quantized and full-precision bytes.
    A cache quantizes after the forward that leaves one of its rows ``start`` tokens or
    more, so before it every row held fewer than ``start`` and that forward added at
    most one prefill chunk: at most start - 1 + chunk_tokens full-precision tokens a
    row, ``rows`` rows (the model's concurrency). The forward that quantizes holds both
    copies of those (F + Q each); every token is held quantized at most once (Q);
    rows quantized as they join a quantized batch or restored quantized from the prefix
    cache never held more. ``start`` 0 quantizes every forward's K/V: ``dims``."""
    if start <= 0:
        return dims
    return dataclasses.replace(
        dims,
        full_kv_bytes_per_token=full_bytes_per_token,
        full_kv_tokens=max(1, rows) * (start - 1 + chunk_tokens),
    )


def model_dims(config: Mapping[str, Any], *, kv_dtype_bytes: int) -> ModelDims | None:
    """Resolve dimensions from a config.json dict, or None when they cannot all be found.

    A nested LM sub-config (text/language/llm config, language_model) wins over
    the top level whenever it names a layer count, because VLM packs may put the
    vision encoder's numbers at the top level. Legacy names (GPT-2 ``n_layer``,
    ``n_head``, ``n_embd``; falcon ``n_head_kv``) are accepted. Missing KV heads
    mean multi-head attention (falcon ``multi_query`` means one); missing
    ``head_dim`` means hidden / heads.
    """
    source = _language_model_config(config)
    num_layers = _first_int(source, _LAYER_KEYS)
    num_heads = _first_int(source, _HEAD_KEYS)
    if num_layers is None or num_heads is None:
        return None
    num_kv_heads = _first_int(source, _KV_HEAD_KEYS)
    if num_kv_heads is None:
        num_kv_heads = 1 if source.get("multi_query") is True else num_heads
    hidden = _first_int(source, _HIDDEN_KEYS)
    head_dim = _first_int(source, _HEAD_DIM_KEYS)
    if head_dim is None:
        if hidden is None or hidden % num_heads:
            return None
        head_dim = hidden // num_heads
    return ModelDims(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_attention_heads=num_heads,
        hidden_size=hidden if hidden is not None else num_heads * head_dim,
        kv_dtype_bytes=_positive(kv_dtype_bytes, "kv_dtype_bytes"),
    )


def hidden_size(config: Mapping[str, Any]) -> int | None:
    """The language model's width, under any of its names (molmo's ``d_model``)."""
    return _first_int(_language_model_config(config), _HIDDEN_KEYS)


def gated_delta_state_bytes(config: Mapping[str, Any], *, kv_dtype_bytes: int) -> int:
    """A sequence's fixed states in a gated-delta hybrid (Qwen3-Next, Qwen3.5), from its
    config alone (the fit estimate, before a download; a loaded model's are measured):
    per linear layer, mlx-lm's convolution state (kernel - 1 positions of the q, k, v
    channels, at the activation dtype) and its float32 recurrent state (value heads x
    value dim x key dim). 0 for a config without gated-delta layers."""
    source = _language_model_config(config)
    names = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads")
    found = [_first_int(source, (name,)) for name in (*names, "linear_value_head_dim")]
    num_layers = _first_int(source, _LAYER_KEYS)
    shape = [n for n in found if n is not None]
    if len(shape) < 4 or num_layers is None:
        return 0
    num_k, dk, num_v, dv = shape
    interval = _first_int(source, ("full_attention_interval",)) or 4
    kernel = _first_int(source, ("linear_conv_kernel_dim",)) or 4
    linear = sum(1 for i in range(num_layers) if (i + 1) % interval)
    conv = (kernel - 1) * (2 * num_k * dk + num_v * dv) * kv_dtype_bytes
    return linear * (conv + num_v * dv * dk * 4)


def conservative_dims(config: Mapping[str, Any], *, kv_dtype_bytes: int) -> ModelDims:
    """Dimensions for a config ``model_dims`` cannot resolve: never a reason to skip the guard.

    Every field the config does name is kept; the rest come from a large
    70B-class model (80 layers, 64 heads, 8 KV heads) with head_dim 256, which
    the fused kernel does not cover, so the full score matrix is counted. This
    over-estimates small models, which costs concurrency, never safety.
    """
    source = _language_model_config(config)
    num_heads = _first_int(source, _HEAD_KEYS) or 64
    head_dim = _first_int(source, _HEAD_DIM_KEYS) or 256
    return ModelDims(
        num_layers=_first_int(source, _LAYER_KEYS) or 80,
        num_kv_heads=_first_int(source, _KV_HEAD_KEYS) or min(8, num_heads),
        head_dim=head_dim,
        num_attention_heads=num_heads,
        hidden_size=_first_int(source, _HIDDEN_KEYS) or num_heads * head_dim,
        kv_dtype_bytes=_positive(kv_dtype_bytes, "kv_dtype_bytes"),
    )


def guard_dims(config: Mapping[str, Any], *, kv_dtype_bytes: int, model: str) -> ModelDims:
    """The dimensions the guard uses for ``model``: resolved, or the conservative fallback.

    Warns on fallback, so a guard running on guessed numbers is never silent (the
    resolved state, dims included, is logged once by the guard that uses them).
    """
    dims = model_dims(config, kv_dtype_bytes=kv_dtype_bytes)
    if dims is not None:
        return dims
    dims = conservative_dims(config, kv_dtype_bytes=kv_dtype_bytes)
    logger.warning("memguard %s: config dims unresolved, conservative fallback %s", model, dims)
    return dims


def rank_share(dims: ModelDims, parallel: str | None, world_size: int) -> ModelDims:
    """The share of ``dims`` the busiest rank holds when the model is split across
    ``world_size`` ranks: its heads (tensor parallel) or its layers (pipeline), so
    each rank's guard prices its own KV and attention, not the whole model's."""
    if world_size <= 1:
        return dims

    def share(n: int) -> int:
        return -(-n // world_size)  # the rank with the most

    if parallel == "tensor":
        return dataclasses.replace(
            dims,
            num_kv_heads=share(dims.num_kv_heads),
            num_attention_heads=share(dims.num_attention_heads),
        )
    if parallel == "pipeline":
        return dataclasses.replace(dims, num_layers=share(dims.num_layers))
    return dims


def _language_model_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    for key in _LM_SUBCONFIGS:
        sub = config.get(key)
        if isinstance(sub, Mapping) and _first_int(sub, _LAYER_KEYS) is not None:
            return sub
    return config


def _first_int(source: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = source.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _positive(value: int, field: str) -> int:
    if value <= 0:
        raise ValueError(f"{field} must be positive, got {value}")
    return value


def allocated_columns(num_tokens: int, step: int) -> int:
    """The most token columns an mlx-lm KV cache holds through a step that starts
    with ``num_tokens`` counted. The step feeds each row one more token (the decode
    step's; a lone sequence's forward runs one token ahead of what it reported), and
    the caches (``KVCache``, ``BatchKVCache``, ``QuantizedKVCache``, the rotating ones
    under their window) grow ``step`` columns at a time: S tokens past the end add
    ceil(S / step) x step. Growth starts wherever the last one ended (after a merge
    or a prefix-cache restore, anywhere), so the columns are not a multiple of
    ``step``: up to ``step`` - 1 beyond the tokens, reached right after one token
    crossed the end. Not counted: a trim (rejected drafts) keeps its columns, up to
    the draft width more until the row grows past them. A window's cap is ignored
    (a rotating layer is priced as if it grew: conservative)."""
    return num_tokens + step if num_tokens > 0 else 0


def written_columns(num_tokens: int, step: int) -> int:
    """The most token columns an mlx-lm KV cache holds right after ``num_tokens`` were
    written to it (a prefill's chunks: each write past the end adds ceil(S / step) x
    step), up to ``step`` - 1 beyond them; ``allocated_columns`` is this with the
    step's one token more. The forward gate and admission price a prefill's KV so."""
    return num_tokens + step - 1 if num_tokens > 0 else 0
