"""What a model's cache really holds per token, read from the model (issue 41, defect 5).

The guard's dimensions come from config.json (memory/dims.py), and config names
describe attention models: a hybrid's convolution or SSM layers hold a fixed
state, not KV; a latent-attention (MLA) cache is smaller than heads x head_dim;
some configs name no layer count at all and the guard falls back to a 70B-class
guess. So at load the model prefills a few tokens into a fresh mlx-lm cache (its
own cache types: KV, rotating windows, quantized KV, SSM states, cache lists) and
the bytes per token slot of the buffers it made are the guard's KV per token. A
cache of fixed states only (a pure SSM) grows nothing per token: the guard keeps
the config's figure for it. The fixed states themselves (mlx-lm's ``ArraysCache``
layers: convolution, gated-delta and SSM states) are read from the same cache:
the bytes one sequence holds whatever its length, priced per row (issue 40).
A cache class omlx has no reader for (mlx-vlm's own, Family.own_cache: KV beside an
index's keys, compressed groups) is priced by what it grows: every array it holds,
after a second, longer probe, less after the first, per token between them; what
it holds beyond that after the longer probe (a window, a step's buffers ahead) is
priced as fixed state per sequence.
MLX thread only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache

from omlx.memory.dims import ModelDims, kv_quantized_start
from omlx.mlx_types import LanguageModel, prompt_cache

log = logging.getLogger(__name__)

# Tokens of the one forward that fills the caches' buffers (short: no window or
# segfault-prone kernel is reached).
PROBE_TOKENS = 8
# Tokens the second probe adds for a cache omlx cannot read: a step of mlx-lm's and
# mlx-vlm's growing buffers (KVCache.step), so a step's growth shows in between.
GROW_TOKENS = 256
# The first of those probes: a prefill forward, past mlx-vlm's DECODE_BLOCK_SIZE (8),
# as a prompt's are: buffers only such a forward makes (glm5_next's projected K/V) are
# in both probes, and only their growth is priced per token.
GROW_FROM_TOKENS = 32


def cache_bytes_per_token(model: LanguageModel, *, full: bool = False) -> int:
    """Bytes the model's cache grows by per prompt token (0 for a model whose cache
    holds only fixed states). A quantized KV layer (a model's ``kv_bits``) counts
    quantized, or with ``full`` as it is held before its ``quantized_kv_start``.
    Raises what the model's forward raises."""
    return _kv_per_token(model, _probed_cache(model), full)


def _kv_per_token(model: LanguageModel, cache: list[Any], full: bool = False) -> int:
    """The bytes per token of a probed cache: its readable layers' K/V slots, and
    what the others grow by over a longer probe."""
    opaque = [i for i, layer in enumerate(cache) if _opaque(layer)]
    known = sum(_per_token(layer, full) for layer in cache if not _opaque(layer))
    return known + (_grown(model, opaque)[0] if opaque else 0)


def _opaque(layer: Any) -> bool:
    """A layer cache of a class omlx has no reader for: mlx-vlm's own (one may hold
    more than K/V: qwen4_exp's KV subclass keeps its indexer's keys too), or one with
    no K/V, no parts and no state."""
    return type(layer).__module__.startswith("mlx_vlm.") or (
        getattr(layer, "caches", None) is None
        and getattr(layer, "keys", None) is None
        and not isinstance(layer, ArraysCache)
    )


def _grown(model: LanguageModel, layers: list[int]) -> tuple[int, int]:
    """(bytes per token the ``layers`` of a cache grow by between a probe of
    ``GROW_FROM_TOKENS`` and one of ``GROW_TOKENS`` more, rounded up; the bytes they
    hold after the longer one beyond that rate: fixed per sequence)."""
    short = _probed_cache(model, GROW_FROM_TOKENS)
    num_long = GROW_FROM_TOKENS + GROW_TOKENS
    held = sum(_held_bytes(layer) for layer in (_probed_cache(model, num_long)[i] for i in layers))
    per_token = max(0, -(-(held - sum(_held_bytes(short[i]) for i in layers)) // GROW_TOKENS))
    return per_token, max(0, held - per_token * num_long)


def _held_bytes(tree: Any, seen: set[int] | None = None) -> int:
    """Every array an object holds (its attributes, lists, tuples, dicts), once each."""
    seen = set() if seen is None else seen
    if id(tree) in seen:
        return 0
    seen.add(id(tree))
    if isinstance(tree, mx.array):
        return int(tree.nbytes)
    if isinstance(tree, dict):
        tree = list(tree.values())
    elif not isinstance(tree, list | tuple):
        tree = list(getattr(tree, "__dict__", {}).values())
    return sum(_held_bytes(part, seen) for part in tree)


def cache_state_bytes(model: LanguageModel) -> int:
    """Bytes of fixed state one sequence's cache holds whatever its length (0 for
    attention only): its ``ArraysCache`` layers' arrays after a forward. Raises what
    the model's forward raises."""
    return sum(_state_bytes(layer) for layer in _probed_cache(model))


def _probed_cache(model: LanguageModel, num_tokens: int = PROBE_TOKENS) -> list[Any]:
    """A fresh cache of one sequence after a forward of ``num_tokens`` tokens."""
    cache = prompt_cache(model)
    ids = (mx.arange(num_tokens, dtype=mx.int32) % 64 + 1).reshape(1, -1)
    mx.eval(model(ids, cache=cache))
    return list(cache)


def _state_bytes(layer: Any) -> int:
    """One layer cache's fixed states (a cache list sums its parts)."""
    parts = getattr(layer, "caches", None)
    if parts is not None:
        return sum(_state_bytes(part) for part in parts)
    if not isinstance(layer, ArraysCache):
        return 0
    arrays: list[Any] = layer.cache  # its state arrays (None: not made by this model)
    return sum(a.nbytes for a in arrays if isinstance(a, mx.array))


def cache_step(model: LanguageModel) -> int:
    """The most columns the model's KV caches grow by at once: mlx-lm's ``step`` of its
    layer caches (``KVCache``, ``RotatingKVCache``, ``QuantizedKVCache``, omlx's
    quantized layer) and of the batch forms the runner merges them into; 1 for a cache
    of fixed states only (nothing grows per token). The scheduler counts each row's KV
    up to one step beyond its tokens (memory/dims.py, ``allocated_columns``)."""
    steps = [int(layer.step) for layer in _layers(prompt_cache(model)) if hasattr(layer, "step")]
    if not steps:
        return 1
    return max(*steps, BatchKVCache.step, BatchRotatingKVCache.step)


def _layers(cache: list[Any]) -> list[Any]:
    """Every layer cache, a cache list's parts in place of the list."""
    flat = []
    for layer in cache:
        parts = getattr(layer, "caches", None)
        flat.extend(_layers(list(parts)) if parts is not None else [layer])
    return flat


def _per_token(layer: Any, full: bool = False) -> int:
    """One layer cache's bytes per token slot. Its K/V buffers (plain, rotating,
    chunked or quantized: their arrays keep the sequence on axis -2) give it; a
    window is counted as if it grew (conservative); a cache list sums its parts;
    a cache without K/V (convolution, SSM states) holds a fixed state."""
    parts = getattr(layer, "caches", None)
    if parts is not None:
        return sum(_per_token(part, full) for part in parts)
    if getattr(layer, "keys", None) is None:
        return 0
    if hasattr(layer, "stored_kv"):  # omlx's quantized layer, in either of its phases
        return _quantized_layer_per_token(layer, full)
    arrays = [a for a in _leaves([layer.keys, layer.values]) if isinstance(a, mx.array)]
    slots = arrays[0].shape[-2]
    return sum(a.nbytes for a in arrays) // slots


def _quantized_layer_per_token(layer: Any, full: bool) -> int:
    """A quantized KV layer's token: quantized (what it stores), or at full precision
    (its K/V dtype, ``bits`` per element unpacked from the quantized data's words)."""
    held = int(layer.offset)
    keys, values = layer.stored_kv(0, held)
    if not full:
        return int(sum(a.nbytes for a in (*keys, *values))) // held
    per_word = 32 // layer.kv_bits
    elements = sum(data.size * per_word for data, _, _ in (keys, values)) // held
    return int(elements * keys[1].itemsize)


def with_kv_start(
    dims: ModelDims, model: LanguageModel, start: int, *, rows: int, chunk_tokens: int
) -> ModelDims:
    """``dims`` (their KV per token quantized) for a ``quantized_kv_start`` of ``start``:
    the full-precision copy it keeps priced (memory/dims.py, ``kv_quantized_start``)."""
    if start <= 0:
        return dims
    try:
        full = cache_bytes_per_token(model, full=True)
    except Exception as exc:  # the config's figure, at the KV dtype: the unquantized size
        log.warning("memguard: full-precision KV per token not measured (%s)", exc)
        full = 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * dims.kv_dtype_bytes
    return kv_quantized_start(dims, full, start, rows=rows, chunk_tokens=chunk_tokens)


def _leaves(tree: Any) -> list[Any]:
    """The leaves of nested lists and tuples (a quantized cache's K/V are tuples)."""
    if isinstance(tree, list | tuple):
        return [leaf for part in tree for leaf in _leaves(part)]
    return [tree]


def with_measured_kv(dims: ModelDims, model: LanguageModel, name: str) -> ModelDims:
    """``dims`` with the KV per token the model's cache really grows by; the config's
    figure (logged beside it) when the measurement cannot run."""
    try:
        cache = _probed_cache(model)
        opaque = [i for i, layer in enumerate(cache) if _opaque(layer)]
        grown, fixed = _grown(model, opaque) if opaque else (0, 0)
        measured = grown + sum(_per_token(layer) for layer in cache if not _opaque(layer))
        state = fixed + sum(_state_bytes(layer) for layer in cache)
    except Exception as exc:  # the guard still has the config's (or fallback) figure
        log.warning("memguard %s: KV per token not measured (%s): config figure kept", name, exc)
        return dims
    if state:
        log.info("memguard %s: %d B of fixed state per sequence, priced per row", name, state)
        dims = dataclasses.replace(dims, state_bytes_per_sequence=state)
    if measured == 0:
        # A cache of fixed states only (SSM, convolution): the guard models memory
        # per token, so the config's (or the fallback's) figure stays: conservative.
        log.info("memguard %s: no KV grows per token; the config figure is kept", name)
        return dims
    if measured != dims.kv_bytes_per_token:
        log.info(
            "memguard %s: KV %d B/token measured from the model's cache (config: %d B/token)",
            name,
            measured,
            dims.kv_bytes_per_token,
        )
    return dataclasses.replace(dims, measured_kv_bytes_per_token=measured)
