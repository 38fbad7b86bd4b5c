"""KV cache layers <-> block tensors (bytes). MLX thread only.

A model's prompt cache is a list of per-layer mlx-lm cache objects. Three kinds
are supported, in any mix (e.g. gemma3: global ``kv`` + sliding ``rotating``):

- ``kv`` (``KVCache``): keys/values of shape (1, heads, tokens, dim); a block
  is the slice of tokens [start, end), so blocks concatenate back into a cache.
- ``arrays:<n>`` (``ArraysCache``: recurrent state of gated-delta / mamba
  layers): state that cannot be cut at a token position. A block carries a
  snapshot of the whole state as it was right after the block's last token
  (captured during prefill at each block boundary); restoring takes the last
  block's.
- ``rotating:<max_size>:<keep>`` (``RotatingKVCache``, sliding-window
  attention): once the window wraps, a token position no longer maps to a
  slot, so it is handled like recurrent state: a block carries the whole
  window (keys, values and the meta state keep/max_size/offset/_idx) exactly
  as the cache held it at the block's end. The layout names the window, so
  blocks of another window size never match. This costs a window per
  rotating layer per block (up to max_size + block_size - 1 tokens, as a
  multi-token chunk can leave the window that long), which is accepted: the
  tiers count it in bytes like any other payload.

Anything else (quantized caches, chunked caches, cache lists) makes the
model's layout unsupported and the prefix cache stays off for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from omlx.cache.safetensors_io import BlockPayload, Tensors

KV = "kv"
ARRAYS = "arrays"
ROTATING = "rotating"

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

# The state of every non-KV layer at a block boundary: layer index -> tensor
# name -> array (an ArraysCache entry that is None has no name).
Snapshot = dict[int, dict[str, mx.array]]


def layer_layout(layers: Sequence[Any]) -> tuple[str, ...] | None:
    """The layout string of each layer, or None if any layer cannot be cached."""
    layout = []
    for layer in layers:
        if _is_kv(layer):
            layout.append(KV)
        elif _is_arrays(layer):
            layout.append(f"{ARRAYS}:{len(layer.cache)}")
        elif _is_rotating(layer):
            layout.append(f"{ROTATING}:{layer.max_size}:{layer.keep}")
        else:
            return None
    return tuple(layout)


def is_sliceable(layout: Sequence[str]) -> bool:
    return all(kind == KV for kind in layout)


def snapshot(layers: Sequence[Any]) -> Snapshot:
    """The state of every non-KV layer as it is now; later updates of ``layers``
    never reach it."""
    state: Snapshot = {}
    for i, layer in enumerate(layers):
        if _is_arrays(layer):
            # ArraysCache replaces its arrays, never mutates them: references do.
            state[i] = {f"state.{j}": a for j, a in enumerate(layer.cache) if a is not None}
        elif _is_rotating(layer):
            state[i] = _window(layer)
    return state


def _window(layer: RotatingKVCache) -> dict[str, mx.array]:
    """A rotating layer's whole window and meta state, exactly as held (unsorted,
    possibly longer than max_size after a multi-token chunk)."""
    keys, values, offset, keep, max_size, idx = layer.state
    if keys is None:
        return {}
    # The layer slice-assigns into keys/values, which rebinds the very Python
    # objects it holds; new array objects pin today's values (MLX copies on write).
    return {
        "window.keys": mx.array(keys),
        "window.values": mx.array(values),
        "window.meta": mx.array([keep, max_size, offset, idx], dtype=mx.int64),
    }


def _to_bytes(array: mx.array) -> tuple[str, tuple[int, ...], bytes]:
    dtype = _TO_SAFETENSORS.get(array.dtype)
    if dtype is None:
        raise ValueError(f"cannot store a cache array of dtype {array.dtype}")
    return dtype, tuple(array.shape), bytes(memoryview(array))  # type: ignore[arg-type]


def _from_bytes(dtype: str, shape: tuple[int, ...], raw: bytes) -> mx.array:
    np_dtype, view = _FROM_SAFETENSORS[dtype]
    array = mx.array(np.frombuffer(raw, dtype=np_dtype)).reshape(shape)
    return array.view(view) if view is not None else array


def block_tensors(layers: Sequence[Any], start: int, end: int, state: Snapshot | None) -> Tensors:
    """Tokens [start, end) of every KV layer, plus ``state`` (a ``snapshot`` taken
    right after token ``end - 1``) for the other layers."""
    pieces: dict[str, mx.array] = {}
    for i, layer in enumerate(layers):
        if _is_kv(layer):
            pieces[f"{i}.keys"] = layer.keys[..., start:end, :]
            pieces[f"{i}.values"] = layer.values[..., start:end, :]
        elif state is None or i not in state:
            raise ValueError(f"layer {i}: {type(layer).__name__} needs a boundary snapshot")
        else:
            pieces.update({f"{i}.{name}": array for name, array in state[i].items()})
    mx.eval(list(pieces.values()))
    return {name: _to_bytes(array) for name, array in pieces.items()}


def cut_payload(payload: BlockPayload, num_tokens: int) -> BlockPayload:
    """A KV-only block's first ``num_tokens`` tokens, as a block of its own (for a
    prompt that shares only them). Keys/values are (1, heads, tokens, dim)."""
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for name, (dtype, shape, raw) in payload.tensors.items():
        np_dtype = _FROM_SAFETENSORS[dtype][0]
        array = np.frombuffer(raw, dtype=np_dtype).reshape(shape)[:, :, :num_tokens, :]
        tensors[name] = (dtype, tuple(array.shape), np.ascontiguousarray(array).tobytes())
    return replace(
        payload, key=f"{payload.key}:{num_tokens}", num_tokens=num_tokens, tensors=tensors
    )


def restore(
    template: Sequence[Any],
    blocks: Sequence[Tensors],
    num_tokens: int | None = None,
    *,
    room: bool = True,
) -> list[Any]:
    """A fresh prompt cache holding ``blocks`` back to back.

    ``template`` is a new ``make_prompt_cache(model)``; it is filled in place.
    With ``num_tokens`` (the blocks' total), a window whose offset says
    otherwise raises ValueError instead of being served. ``room``: KV layers get
    room for the next tokens (for a cache fed as it is; a cache merged into a
    batch is copied anyway, and the zeros would only cost time).
    """
    layers = list(template)
    last = blocks[-1]
    for i, layer in enumerate(layers):
        if _is_kv(layer):
            keys, values = [b[f"{i}.keys"] for b in blocks], [b[f"{i}.values"] for b in blocks]
            num = sum(shape[2] for _, shape, _ in keys)
            # Room for the next tokens, as the layer leaves itself after a prefill:
            # without it the first forward after a hit reallocates and copies the
            # whole restored context straight onto the time to first token
            # (figures: benchmarks/README.md, "Figures behind design choices").
            extra = layer.step - num % layer.step if room else 0
            layer.keys = _joined(keys, extra)
            layer.values = _joined(values, extra)
            layer.offset = num
        elif _is_arrays(layer):
            layer.cache = [
                _from_bytes(*last[name]) if (name := f"{i}.state.{j}") in last else None
                for j in range(len(layer.cache))
            ]
        elif _is_rotating(layer):
            _restore_window(layer, i, last, num_tokens)
        else:
            raise ValueError(f"layer {i}: {type(layer).__name__} cannot be restored")
    mx.eval([a for layer in layers for a in _arrays(layer)])
    return layers


def _joined(parts: Sequence[tuple[str, tuple[int, ...], bytes]], room: int) -> mx.array:
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


def _is_kv(layer: Any) -> bool:
    # Exact types: subclasses (rotating, chunked, quantized) store differently.
    return type(layer) is KVCache


def _is_arrays(layer: Any) -> bool:
    return type(layer) is ArraysCache


def _is_rotating(layer: Any) -> bool:
    return type(layer) is RotatingKVCache


def _restore_window(layer: Any, i: int, last: Tensors, num_tokens: int | None) -> None:
    """Layer ``i``'s window from the last block (KeyError if it has none)."""
    meta = np.asarray(_from_bytes(*last[f"{i}.window.meta"]))
    keep, max_size, offset, idx = (int(v) for v in meta)
    if (keep, max_size) != (layer.keep, layer.max_size):
        raise ValueError(f"layer {i}: window {max_size}:{keep} != {layer.max_size}:{layer.keep}")
    if num_tokens is not None and offset != num_tokens:
        raise ValueError(f"layer {i}: window ends at token {offset}, blocks hold {num_tokens}")
    keys = _from_bytes(*last[f"{i}.window.keys"])
    values = _from_bytes(*last[f"{i}.window.values"])
    layer.state = (keys, values, offset, keep, max_size, idx)


def _arrays(layer: Any) -> list[Any]:
    if isinstance(layer, KVCache | RotatingKVCache):
        return [layer.keys, layer.values]
    return [a for a in layer.cache if a is not None]
