"""Each row of a speculative decode batch keeps exactly what it accepted. MLX thread only.

The rows of a ``BatchKVCache`` share one write position, and a speculative step
writes the same number of verified positions for every row, while rows accept
different numbers of them. Cutting every row back to the shortest acceptance
would make the others feed their kept tokens again next step, in the positions
their drafts would have used. Instead the cache keeps the longest acceptance,
and a row that kept fewer turns its rejected tail into left padding: its oldest
tokens are copied into the rejected slots and its padding grows by that many.

Attention does not care where in the row a cached token sits: its position is
rotated into its key, and every cached token is visible to every new query. So
only a few positions per row are copied, never the row. The order does matter
to whoever takes the row out (the prefix cache, preemption, forks):
``RowLayouts`` records each moved row's order, and ``in_order`` restores it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from omlx.engine.batch_cache import columns, set_columns

# Left padding every row shares is dropped once it reaches this many positions
# (each drop copies the cache once; the attention skips it in the meantime).
SHARED_PADDING_DROP = 256


class RowLayouts:
    """Per decode row: the logical index of each cached token in physical order
    (from the row's left padding on), for rows whose tokens were moved. A row's
    tokens past its recorded prefix are in order (appended after the last move)."""

    def __init__(self) -> None:
        self._orders: list[np.ndarray | None] = []

    def join(self, rows: int) -> None:
        self._orders.extend([None] * rows)

    def keep(self, indices: list[int]) -> None:
        self._orders = [self._orders[i] for i in indices]

    def clear(self) -> None:
        self._orders = []

    def settle(self, cache: list[Any], valid: list[int]) -> None:
        """``settle_rows``, recording where each moved row's tokens now sit."""
        for row, moved, tokens in settle_rows(cache, valid):
            self._record_move(row, moved, tokens)

    def _record_move(self, row: int, moved: int, tokens: int) -> None:
        """The row's order after its first ``moved`` tokens went to its end."""
        order = self._orders[row]
        known = 0 if order is None else len(order)
        full = np.arange(tokens, dtype=np.int32)
        if order is not None:
            full[:known] = order
        self._orders[row] = np.concatenate([full[moved:], full[:moved]])

    def in_order(self, row: int, layers: list[Any]) -> list[Any]:
        """A row's extracted per-layer caches (``KVCache``s, physical order) with
        their tokens put back in the order they were fed."""
        order = self._orders[row]
        if order is None:
            return layers
        tokens = layers[0].offset
        index = np.arange(tokens, dtype=np.int32)
        index[order] = np.arange(len(order), dtype=np.int32)  # where each token sits
        take = mx.array(index)
        for layer in layers:
            layer.keys = mx.contiguous(layer.keys[:, :, take])
            layer.values = mx.contiguous(layer.values[:, :, take])
        return layers


def settle_rows(cache: list[Any], valid: list[int]) -> list[tuple[int, int, int]]:
    """After a forward trimmed to ``max(valid)`` new positions per row: each row
    whose ``valid`` new positions are fewer moves its oldest tokens into its
    rejected ones and widens its left padding over them. Returns (row, tokens
    moved, tokens it holds) per row that moved."""
    keep = max(valid)
    lengths = cache[0].offset.tolist()  # tokens per row, rejected tail included
    padding = cache[0].left_padding.tolist()
    end = columns(cache[0])
    moves = []  # (row, rejected positions, tokens moved)
    for i, (kept, length) in enumerate(zip(valid, lengths, strict=True)):
        if rejected := keep - kept:
            moves.append((i, rejected, min(rejected, length - rejected)))
    if not moves:
        return []
    tail = max(moved for _, _, moved in moves)
    source = np.tile(np.arange(end - tail, end, dtype=np.int32), (len(valid), 1))
    widen = np.zeros(len(valid), dtype=np.int32)
    for i, rejected, moved in moves:
        source[i, tail - moved :] = np.arange(padding[i], padding[i] + moved)
        widen[i] = rejected
    _move_tails(cache, mx.array(source), end - tail, mx.array(widen))
    shared = min(p + w for p, w in zip(padding, widen.tolist(), strict=True))
    if shared >= SHARED_PADDING_DROP:
        _drop_shared_padding(cache, shared)
    return [(i, moved, lengths[i] - rejected) for i, rejected, moved in moves]


def _move_tails(cache: list[Any], source: mx.array, start: int, widen: mx.array) -> None:
    """Every layer's positions from ``start`` on take the tokens at ``source``
    (rows, positions); each row's padding widens by ``widen``."""
    index = source[:, None, :, None]
    for layer in cache:
        for name in ("keys", "values"):
            array = getattr(layer, name)
            array[:, :, start : columns(layer), :] = mx.take_along_axis(array, index, axis=2)
        layer.left_padding = layer.left_padding + widen
        layer.offset = layer.offset - widen


def _drop_shared_padding(cache: list[Any], shared: int) -> None:
    """Cut the padding every row has off the front of every layer (one copy)."""
    for layer in cache:
        layer.keys = mx.contiguous(layer.keys[:, :, shared:, :])
        layer.values = mx.contiguous(layer.values[:, :, shared:, :])
        layer.left_padding = layer.left_padding - shared
        set_columns(layer, columns(layer) - shared)
