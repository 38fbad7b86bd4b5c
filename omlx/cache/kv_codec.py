"""KV cache layers <-> block tensors (bytes). MLX thread only.

A model's prompt cache is a list of per-layer mlx-lm cache objects, in any mix
(e.g. gemma3: global ``kv`` + sliding ``rotating``). Each kind is named in the
model's layout (which the SSD tier keeps in every block file, so blocks of another
layout never match) and stored as tensors named ``<layer>.<part>``:

- ``kv`` (``KVCache``): keys/values of shape (1, heads, tokens, dim); a block
  is the slice of tokens [start, end), so blocks concatenate back into a cache.
- ``quantized:<bits>:<group_size>`` (``QuantizedKVCache``): the same, for each of
  the packed keys/values' three arrays (data, scales, biases; ``keys.0`` ...). A
  subclass whose class names ``stores_as = QuantizedKVCache`` (omlx's quantized layer
  for a model's ``kv_bits``, which adds batching, not state) is stored as one, and
  restored into the template's own layers (what the model's ``make_cache`` makes).
  Before its ``quantized_kv_start`` that layer holds full-precision K/V: its tokens
  are stored quantized all the same (its ``stored_kv``), so a model's blocks are one
  kind, and a hit restores them quantized.
- ``arrays:<n>`` (``ArraysCache``: recurrent state of gated-delta / mamba
  layers): state that cannot be cut at a token position. A block carries a
  snapshot of the whole state as it was right after the block's last token
  (captured during prefill at each block boundary); restoring takes the last
  block's.
- ``rotating:<max_size>:<keep>`` (``RotatingKVCache``, sliding-window
  attention): once the window wraps, a token position no longer maps to a
  slot, so it is handled like recurrent state: a block carries the whole
  window (keys, values and the meta state keep/max_size/offset/_idx) exactly
  as the cache held it at the block's end. This costs a window per rotating
  layer per block (up to max_size + block_size - 1 tokens, as a multi-token
  chunk can leave the window that long), which is accepted: the tiers count it
  in bytes like any other payload.
- ``chunked:<chunk_size>`` (``ChunkedKVCache``, llama4's chunked attention): a
  token attends only to the tokens of its own chunk, and the layer drops older
  ones as it goes, so a block carries the layer's keys/values of its own tokens
  that lie in the chunk of its last token (none for a block ending on a chunk
  boundary), taken from the snapshot at its end; restoring at token P joins the
  pieces of P's chunk. No more bytes than KV, but only block ends can be served.
- ``list[<kind>,...]`` (``CacheList``: a layer holding several caches, e.g.
  falcon_h1's mamba + attention, deepseek_v32's indexer keys): each sub-cache
  by its own kind, named ``<layer>.<j>.<part>``; restored into the template's
  fresh CacheList.

Any other cache type makes the model's layout unsupported and the prefix cache
stays off for it, with the type named in the log: mlx-lm's ConcatenateKVCache (no
model's ``make_cache`` returns it) and model-specific classes such as
deepseek_v41's ``LayerCache`` (a sliding window plus compressed groups, with no
public state to rebuild it from).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from omlx.cache.kv_bytes import from_bytes, joined, to_bytes
from omlx.cache.safetensors_io import Tensors

KV = "kv"
ARRAYS = "arrays"
ROTATING = "rotating"
CHUNKED = "chunked"
QUANTIZED = "quantized"
LIST = "list"
# Kinds whose blocks are token slices, cut and joined at any position.
_SLICEABLE = frozenset({KV, QUANTIZED})

# The state of every layer that needs one at a block boundary: layer name (``3``, or
# ``3.0`` in a CacheList) -> tensor name -> array (an ArraysCache entry that is None
# has no name).
Snapshot = dict[str, dict[str, mx.array]]


def layer_layout(layers: Sequence[Any]) -> tuple[str, ...] | None:
    """The layout string of each layer, or None if any layer cannot be cached."""
    kinds = [layer_kind(layer) for layer in layers]
    return None if None in kinds else tuple(k for k in kinds if k is not None)


def _stored_type(layer: Any) -> type:
    """The mlx-lm type ``layer`` is stored as. Exact types, as subclasses store
    differently, unless the class says it stores as its base (``stores_as``)."""
    kind: type = getattr(type(layer), "stores_as", type(layer))
    return kind


def layer_kind(layer: Any) -> str | None:
    """One layer's layout string (None: a cache type the codec cannot store)."""
    kind = _stored_type(layer)
    if kind is KVCache:
        return KV
    if kind is QuantizedKVCache:
        # omlx's layer hides ``bits`` from attention while it holds full precision.
        return quantized_kind(getattr(layer, "kv_bits", None) or layer.bits, layer.group_size)
    if kind is ArraysCache:
        return f"{ARRAYS}:{len(layer.cache)}"
    if kind is RotatingKVCache:
        return f"{ROTATING}:{layer.max_size}:{layer.keep}"
    if kind is ChunkedKVCache:
        return f"{CHUNKED}:{layer.chunk_size}"
    if kind is CacheList and layer.caches:
        inner = [layer_kind(c) for c in layer.caches]
        return None if None in inner else f"{LIST}[{','.join(k for k in inner if k)}]"
    return None


def unstorable(layers: Sequence[Any]) -> list[str]:
    """The type names of the caches in ``layers`` that no layout kind stores."""
    names = {type(layer).__name__ for _, layer in _leaves(layers) if layer_kind(layer) is None}
    return sorted(names) or sorted({type(layer).__name__ for layer in layers})


def quantized_kind(bits: int, group_size: int) -> str:
    """The layout string of a ``QuantizedKVCache(group_size, bits)`` layer."""
    return f"{QUANTIZED}:{bits}:{group_size}"


def is_sliceable(layout: Sequence[str]) -> bool:
    """Whether every (sub-)layer's blocks are token slices: no snapshots needed, and
    a hit may end anywhere."""
    leaves = (k.split(":")[0] for kind in layout for k in re.split(r"[\[\],]", kind))
    return all(k in _SLICEABLE for k in leaves if k and k != LIST)


def _leaves(layers: Sequence[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, cache) of every cache, a CacheList's sub-caches as ``<layer>.<j>``."""
    for i, layer in enumerate(layers):
        if type(layer) is CacheList:
            yield from _leaves(layer.caches, f"{prefix}{i}.")
        else:
            yield f"{prefix}{i}", layer


def snapshot(layers: Sequence[Any], since: int = 0) -> Snapshot:
    """The state of every layer that needs one, as it is now; later updates of
    ``layers`` never reach it. ``since``: the first token of the block ending here
    (a chunked layer keeps no older token)."""
    state: Snapshot = {}
    for name, layer in _leaves(layers):
        kind = _stored_type(layer)
        if kind is ArraysCache:
            # ArraysCache replaces its arrays, never mutates them: references do.
            state[name] = {f"state.{j}": a for j, a in enumerate(layer.cache) if a is not None}
        elif kind is RotatingKVCache:
            state[name] = _window(layer)
        elif kind is ChunkedKVCache:
            state[name] = _chunk_tail(layer, since)
    return state


def held_at(layers: Sequence[Any], num_tokens: int) -> list[Any] | None:
    """``layers`` as they were after their first ``num_tokens`` tokens, where one
    forward from token 0 filled them (a whole-prompt prefill): KV layers as they are
    (blocks slice them), windows cut back to there. None where a layer cannot be cut
    (recurrent or chunked state, a window that was already trimmed or rotated)."""
    held = []
    for layer in layers:
        kind = _stored_type(layer)
        cut = layer if kind in (KVCache, QuantizedKVCache) else None
        if kind is RotatingKVCache:
            cut = _window_at(layer, num_tokens)
        if cut is None:
            return None
        held.append(cut)
    return held


def _window_at(layer: RotatingKVCache, num_tokens: int) -> RotatingKVCache | None:
    """A copy of an untrimmed window (its tokens in order from 0) holding what a
    window of its size holds after token ``num_tokens - 1``: its last max_size."""
    keys, values, offset, keep, max_size, idx = layer.state
    if keys is None or keep or not num_tokens <= offset == idx == keys.shape[2]:
        return None
    first = max(0, num_tokens - max_size)
    cut = RotatingKVCache(max_size, keep)
    window = (keys[..., first:num_tokens, :], values[..., first:num_tokens, :])
    cut.state = (*window, num_tokens, keep, max_size, num_tokens - first)
    return cut


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


def _chunk_tail(layer: Any, since: int) -> dict[str, mx.array]:
    """A chunked layer's tokens from ``since`` (or its chunk's start, if later) to
    now, and where they sit: (first, end, chunk_size). A slice is a new array over
    today's values: the layer's later writes rebind its own."""
    end, size, held = layer.offset, layer.chunk_size, layer.start_position
    first = max(since, end // size * size)
    if first < held:  # cannot happen: the layer keeps at least its current chunk
        raise ValueError(f"chunked layer dropped token {first} its chunk still needs")
    tail = {"chunk.meta": mx.array([first, end, size], dtype=mx.int64)}
    if first < end and layer.keys is not None:
        tail["chunk.keys"] = layer.keys[..., first - held : end - held, :]
        tail["chunk.values"] = layer.values[..., first - held : end - held, :]
    return tail


def block_tensors(layers: Sequence[Any], start: int, end: int, state: Snapshot | None) -> Tensors:
    """Tokens [start, end) of every sliceable layer, plus ``state`` (a ``snapshot``
    taken right after token ``end - 1``) for the other layers."""
    pieces: dict[str, mx.array] = {}
    for name, layer in _leaves(layers):
        kind = _stored_type(layer)
        if kind in (KVCache, QuantizedKVCache):
            pieces.update(_kv_slice(name, layer, start, end))
        elif state is None or name not in state:
            raise ValueError(f"layer {name}: {kind.__name__} needs a boundary snapshot")
        elif kind is ChunkedKVCache:
            pieces.update(_chunk_piece(name, state[name], start, end))
        else:
            pieces.update({f"{name}.{part}": array for part, array in state[name].items()})
    mx.eval(list(pieces.values()))
    return {name: to_bytes(array) for name, array in pieces.items()}


def _kv_slice(name: str, layer: Any, start: int, end: int) -> dict[str, mx.array]:
    packed = _stored_type(layer) is QuantizedKVCache  # keys/values: (data, scales, biases)
    out = {}
    # omlx's quantized layer still holding full precision (before its quantized_kv_start)
    # stores its tokens quantized, as the layout says: a model's blocks are one kind.
    stored = getattr(layer, "stored_kv", None)
    if stored is not None:
        held_kv = stored(start, end)
        for part, held in zip(("keys", "values"), held_kv, strict=True):
            out.update({f"{name}.{part}.{j}": a for j, a in enumerate(held)})
        return out
    for part, held in (("keys", layer.keys), ("values", layer.values)):
        if packed:
            out.update({f"{name}.{part}.{j}": a[..., start:end, :] for j, a in enumerate(held)})
        else:
            out[f"{name}.{part}"] = held[..., start:end, :]
    return out


def _chunk_piece(name: str, tail: dict[str, mx.array], start: int, end: int) -> dict[str, mx.array]:
    """Block [start, end)'s piece of a chunked layer: its tokens in the chunk of
    token ``end - 1``, cut from the snapshot's tail."""
    first, tail_end, size = (int(v) for v in np.asarray(tail["chunk.meta"]))
    begin = max(start, end // size * size)
    if tail_end != end or first > begin:
        raise ValueError(
            f"layer {name}: snapshot holds [{first}, {tail_end}), not [{begin}, {end})"
        )
    out = {f"{name}.chunk.meta": mx.array([begin, end, size], dtype=mx.int64)}
    if begin < end:
        out[f"{name}.chunk.keys"] = tail["chunk.keys"][..., begin - first : end - first, :]
        out[f"{name}.chunk.values"] = tail["chunk.values"][..., begin - first : end - first, :]
    return out


def restore(
    template: Sequence[Any],
    blocks: Sequence[Tensors],
    num_tokens: int | None = None,
    *,
    room: bool = True,
) -> list[Any]:
    """A fresh prompt cache holding ``blocks`` back to back.

    ``template`` is a new ``make_prompt_cache(model)``; it is filled in place (a
    CacheList's sub-caches too). With ``num_tokens`` (the blocks' total), a window
    or chunk whose offset says otherwise raises ValueError instead of being served.
    ``room``: KV layers get room for the next tokens (for a cache fed as it is; a
    cache merged into a batch is copied anyway, and the zeros would only cost time).
    """
    layers = list(template)
    last = blocks[-1]
    for name, layer in _leaves(layers):
        kind = _stored_type(layer)
        if kind in (KVCache, QuantizedKVCache):
            _restore_kv(layer, name, blocks, room)
        elif kind is ArraysCache:
            layer.cache = [
                from_bytes(*last[part]) if (part := f"{name}.state.{j}") in last else None
                for j in range(len(layer.cache))
            ]
        elif kind is RotatingKVCache:
            _restore_window(layer, name, last, num_tokens)
        elif kind is ChunkedKVCache:
            _restore_chunk(layer, name, blocks, num_tokens, room)
        else:
            raise ValueError(f"layer {name}: {kind.__name__} cannot be restored")
    mx.eval([a for _, layer in _leaves(layers) for a in _arrays(layer)])
    return layers


def _restore_kv(layer: Any, name: str, blocks: Sequence[Tensors], room: bool) -> None:
    """A KV or quantized KV layer from every block's slice, with room for the next
    tokens, as the layer leaves itself after a prefill: without it the first forward
    after a hit reallocates and copies the whole restored context straight onto the
    time to first token (figures: benchmarks/README.md, "Figures behind design
    choices")."""
    if type(layer) is KVCache:
        keys, values = ([b[f"{name}.{part}"] for b in blocks] for part in ("keys", "values"))
        num = sum(shape[2] for _, shape, _ in keys)
        extra = layer.step - num % layer.step if room else 0
        layer.keys, layer.values = joined(keys, extra), joined(values, extra)
    else:
        num = sum(b[f"{name}.keys.0"][1][2] for b in blocks)
        extra = layer.step - num % layer.step if room else 0
        layer.keys, layer.values = (
            tuple(joined([b[f"{name}.{part}.{j}"] for b in blocks], extra) for j in range(3))
            for part in ("keys", "values")
        )
    layer.offset = num


def _restore_window(layer: Any, name: str, last: Tensors, num_tokens: int | None) -> None:
    """Layer ``name``'s window from the last block (KeyError if it has none)."""
    meta = np.asarray(from_bytes(*last[f"{name}.window.meta"]))
    keep, max_size, offset, idx = (int(v) for v in meta)
    if (keep, max_size) != (layer.keep, layer.max_size):
        raise ValueError(f"layer {name}: window {max_size}:{keep} != {layer.max_size}:{layer.keep}")
    if num_tokens is not None and offset != num_tokens:
        raise ValueError(f"layer {name}: window ends at token {offset}, blocks hold {num_tokens}")
    keys = from_bytes(*last[f"{name}.window.keys"])
    values = from_bytes(*last[f"{name}.window.values"])
    layer.state = (keys, values, offset, keep, max_size, idx)


def _restore_chunk(
    layer: Any, name: str, blocks: Sequence[Tensors], num_tokens: int | None, room: bool
) -> None:
    """A chunked layer holding the last block's chunk, joined from the pieces of the
    blocks in it (KeyError if a block has none, ValueError if they leave a gap)."""
    metas = [
        tuple(int(v) for v in np.asarray(from_bytes(*b[f"{name}.chunk.meta"]))) for b in blocks
    ]
    end, size = metas[-1][1], metas[-1][2]
    if size != layer.chunk_size:
        raise ValueError(f"layer {name}: chunk {size} != {layer.chunk_size}")
    if num_tokens is not None and end != num_tokens:
        raise ValueError(f"layer {name}: chunk ends at token {end}, blocks hold {num_tokens}")
    first = end // size * size
    parts, pos = [], first
    for block, (begin, block_end, _) in zip(blocks, metas, strict=True):
        if block_end <= first:
            continue
        if begin != pos:
            raise ValueError(f"layer {name}: chunk pieces leave a gap at token {pos}")
        parts.append(block)
        pos = block_end
    layer.keys = layer.values = None
    if parts:
        extra = layer.step - (end - first) % layer.step if room else 0
        layer.keys = joined([b[f"{name}.chunk.keys"] for b in parts], extra)
        layer.values = joined([b[f"{name}.chunk.values"] for b in parts], extra)
    layer.offset, layer.start_position = end, first


def num_tokens_held(layers: Sequence[Any]) -> int:
    """Tokens held by a prompt cache: its first attention layer's offset (-1 if it
    has none, e.g. only recurrent state)."""
    for _, layer in _leaves(layers):
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int):
            return offset
    return -1


def _arrays(layer: Any) -> list[Any]:
    kind = _stored_type(layer)
    if kind is QuantizedKVCache:
        return [*layer.keys, *layer.values]
    if kind is ArraysCache:
        return [a for a in layer.cache if a is not None]
    return [a for a in (layer.keys, layer.values) if a is not None]
