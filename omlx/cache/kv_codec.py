"""KV cache layers <-> block tensors (bytes). MLX thread only.

A model's prompt cache is a list of per-layer mlx-lm cache objects. Two kinds
are supported:

- ``kv`` (``KVCache``): keys/values of shape (1, heads, tokens, dim); a block
  is the slice of tokens [start, end), so blocks concatenate back into a cache.
- ``arrays`` (``ArraysCache``: recurrent state of gated-delta / mamba layers):
  state that cannot be cut at a token position. A block carries a snapshot of
  the whole state as it was right after the block's last token (captured
  during prefill at each block boundary); restoring takes the last block's.

Anything else (rotating windows, quantized caches, cache lists) makes the
model's layout unsupported and the prefix cache stays off for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from omlx.cache.safetensors_io import Tensors

KV = "kv"
ARRAYS = "arrays"

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

# One layer's recurrent state at a block boundary (None entries stay None).
Snapshot = list[list[Any]]


def layer_layout(layers: Sequence[Any]) -> tuple[str, ...] | None:
    """The layout string of each layer, or None if any layer cannot be cached."""
    layout = []
    for layer in layers:
        if _is_kv(layer):
            layout.append(KV)
        elif _is_arrays(layer):
            layout.append(f"{ARRAYS}:{len(layer.cache)}")
        else:
            return None
    return tuple(layout)


def is_sliceable(layout: Sequence[str]) -> bool:
    return all(kind == KV for kind in layout)


def snapshot(layers: Sequence[Any]) -> Snapshot:
    """The recurrent state of every non-KV layer, by reference (mlx arrays are
    replaced, not mutated, by the layers that own them)."""
    return [list(layer.cache) for layer in layers if _is_arrays(layer)]


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
    """Tokens [start, end) of every KV layer, plus ``state`` for the other layers."""
    pieces: dict[str, mx.array] = {}
    states = iter(state or [])
    for i, layer in enumerate(layers):
        if _is_kv(layer):
            pieces[f"{i}.keys"] = layer.keys[..., start:end, :]
            pieces[f"{i}.values"] = layer.values[..., start:end, :]
        else:
            for j, array in enumerate(next(states)):
                if array is not None:
                    pieces[f"{i}.state.{j}"] = array
    mx.eval(list(pieces.values()))
    return {name: _to_bytes(array) for name, array in pieces.items()}


def restore(template: Sequence[Any], blocks: Sequence[Tensors]) -> list[Any]:
    """A fresh prompt cache holding ``blocks`` back to back.

    ``template`` is a new ``make_prompt_cache(model)``; it is filled in place.
    """
    layers = list(template)
    last = blocks[-1]
    for i, layer in enumerate(layers):
        if _is_kv(layer):
            keys = [_from_bytes(*b[f"{i}.keys"]) for b in blocks]
            values = [_from_bytes(*b[f"{i}.values"]) for b in blocks]
            layer.keys = mx.concatenate(keys, axis=2) if len(keys) > 1 else keys[0]
            layer.values = mx.concatenate(values, axis=2) if len(values) > 1 else values[0]
            layer.offset = int(layer.keys.shape[2])
        elif _is_arrays(layer):
            layer.cache = [
                _from_bytes(*last[name]) if (name := f"{i}.state.{j}") in last else None
                for j in range(len(layer.cache))
            ]
        else:
            raise ValueError(f"layer {i}: {type(layer).__name__} cannot be restored")
    mx.eval([a for layer in layers for a in _arrays(layer)])
    return layers


def _is_kv(layer: Any) -> bool:
    # Exact types: subclasses (rotating, chunked, quantized) store differently.
    return type(layer) is KVCache


def _is_arrays(layer: Any) -> bool:
    return type(layer) is ArraysCache


def _arrays(layer: Any) -> list[Any]:
    if isinstance(layer, KVCache):
        return [layer.keys, layer.values]
    return [a for a in layer.cache if a is not None]
