"""The caches omlx gives an mlx-vlm language model's layers where mlx-vlm's own differ
from what mlx-lm's batch and prefix cache take (models/vlm.py ``TextModel``). MLX thread
only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


class StateCache(ArraysCache):
    """mlx-lm's ArraysCache (the batch merges, filters and extracts it, the prefix
    cache stores it as one) for a linear-attention / convolution layer of mlx-vlm,
    with the writes mlx-vlm's own ArraysCache adds (qwen3_5's gated-delta layers
    call ``update_window`` / ``update_recurrent``), less its speculation history."""

    stores_as = ArraysCache

    def update_recurrent(
        self, index: int, length: int, update: Callable[..., Any]
    ) -> tuple[mx.array, mx.array]:
        """``update(state, None)``: the layer's step from its state (``length``
        bounds mlx-vlm's speculation history, which this cache keeps none of)."""
        output, state = update(self.cache[index], None)[:2]
        self[index] = state
        return output, state

    def update_window(
        self, index: int, source: mx.array, width: int, *, lengths: mx.array | None = None
    ) -> mx.array:
        """The last ``width`` inputs (each row's, before its ``lengths`` end)."""
        length = source.shape[1] - width
        if lengths is None:
            state = mx.contiguous(source[:, length : length + width])
        else:
            positions = mx.clip(lengths, 0, length)[:, None] + mx.arange(width)
            positions = positions.reshape(*positions.shape, *([1] * (source.ndim - 2)))
            state = mx.take_along_axis(source, positions, axis=1)
        self[index] = state
        return state

    @classmethod
    def merge(cls, caches: list[Any]) -> StateCache:
        merged: StateCache = super().merge(caches)
        if all(c.empty() for c in caches):
            # mlx-lm marks fresh rows with a zero left padding, which qwen3_5 reads as
            # "no mask" even when a right-padded prefill gives the rows' lengths.
            merged.left_padding = None
        return merged

    def extract(self, idx: int) -> StateCache:
        row = StateCache(len(self.cache))
        row.cache = [c[idx : idx + 1] if c is not None else None for c in self.cache]
        return row


class SharedKV:
    """A KV-shared layer's view of its source layer's cache (gemma3n). mlx-vlm's layer
    reads ``cache.state[:2]`` as the keys written (its own caches' state); mlx-lm's
    caches give whole preallocated buffers there (a batch's, its bookkeeping too), so
    the view gives the keys and values the source layer attended, under the same mask."""

    def __init__(self, source: Any):
        self._source = source

    @property
    def offset(self) -> Any:
        return self._source.offset

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        keys, values = self._source.keys_and_values()
        return keys, values


def kv_shared_sources(language_model: Any) -> tuple[int, ...]:
    """The source cache of each KV-shared layer (gemma3n's last layers), in layer order;
    the model's layers are re-pointed at views appended after its own caches
    (``TextModel.__call__`` appends them). () where no layer shares another's KV."""
    inner: Any = getattr(language_model, "model", None)
    mapping = getattr(inner, "layer_idx_to_cache_idx", None)
    first = getattr(inner, "first_kv_shared_layer_idx", None)
    if mapping is None or first is None or first >= len(mapping):
        return ()
    sources = tuple(mapping[first:])
    # A plain list mlx-vlm's forward indexes by layer: its own caches, then the views.
    inner.layer_idx_to_cache_idx = [*mapping[:first], *range(first, len(mapping))]
    return sources
