"""Sliding-window (RotatingKVCache) layers through kv_codec, on real mlx-lm caches.

A window cannot be cut at a token position once it wraps, so a block carries a
snapshot of the whole window. These pin the two ways that goes wrong: a snapshot
that later updates reach, and a restore that is not the state it was taken from.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from omlx.cache import kv_codec
from omlx.models.vlm_caches import StateCache

WINDOW = 8
HEADS, DIM = 2, 4
_rng = np.random.default_rng(0)


def _tokens(n: int) -> mx.array:
    return mx.array(_rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32))


def _feed(layers: list, sizes: list[int]) -> None:
    """One update per size: >1 goes through mlx-lm's concat path, 1 through the
    in-place path that slice-assigns into the window."""
    for n in sizes:
        keys = _tokens(n)
        for layer in layers:
            layer.update_and_fetch(keys, keys * 2)
    mx.eval([layer.keys for layer in layers])


def _held(layer: RotatingKVCache) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    keys, values, offset, keep, max_size, idx = layer.state
    return np.array(keys), np.array(values), (offset, keep, max_size, idx)


def _assert_same(layer: RotatingKVCache, held: tuple) -> None:
    keys, values, meta = _held(layer)
    assert meta == held[2]
    np.testing.assert_array_equal(keys, held[0])
    np.testing.assert_array_equal(values, held[1])


def _round_trip(layers: list, num_tokens: int, state: kv_codec.Snapshot, template: list) -> list:
    block = kv_codec.block_tensors(layers, 0, num_tokens, state)
    return kv_codec.restore(template, [block], num_tokens)


@pytest.mark.parametrize(
    "sizes",
    [
        [WINDOW],  # window exactly full: the next token overwrites slot 0 in place
        [5, 1, 1, 1],  # filled token by token
        [6, 6],  # a chunk leaves the window longer than max_size
        [3, 7, 1, 1, 1],  # wrapped, mid-rotation
    ],
)
def test_window_snapshot_survives_later_updates(sizes: list[int]) -> None:
    layer = RotatingKVCache(max_size=WINDOW)
    _feed([layer], sizes)
    held = _held(layer)
    state = kv_codec.snapshot([layer])
    _feed([layer], [1, 1, 1, 4, 1])
    assert layer.offset == sum(sizes) + 8
    restored = _round_trip([layer], sum(sizes), state, [RotatingKVCache(max_size=WINDOW)])
    _assert_same(restored[0], held)


def test_wrapped_window_round_trip_continues_identically() -> None:
    """KV layers keep their token slices, rotating layers their window, and both
    caches then answer the same next updates with the same keys and values."""
    layers = [KVCache(), RotatingKVCache(max_size=WINDOW), RotatingKVCache(max_size=WINDOW, keep=2)]
    _feed(layers, [6, 5, 1, 1, 1])  # 14 tokens: both windows have wrapped
    assert kv_codec.layer_layout(layers) == ("kv", "rotating:8:0", "rotating:8:2")
    held = [_held(layer) for layer in layers[1:]]
    block = kv_codec.block_tensors(layers, 0, 14, kv_codec.snapshot(layers))
    # The tiers budget by payload bytes: a block pays for each whole window.
    windows = sum(layer.nbytes for layer in layers[1:]) + 2 * 4 * 8  # + int64 meta
    kv_slices = 2 * HEADS * 14 * DIM * 4
    assert sum(len(raw) for _, _, raw in block.values()) == kv_slices + windows
    template = [KVCache(), RotatingKVCache(max_size=WINDOW), RotatingKVCache(WINDOW, keep=2)]
    restored = kv_codec.restore(template, [block], 14)
    for layer, state in zip(restored[1:], held, strict=True):
        _assert_same(layer, state)
    assert restored[0].offset == 14
    for n in [1, 3, 1]:
        keys = _tokens(n)
        for a, b in zip(layers, restored, strict=True):
            got_a, got_b = a.update_and_fetch(keys, keys), b.update_and_fetch(keys, keys)
            assert mx.array_equal(got_a[0], got_b[0]).item()
            assert mx.array_equal(got_a[1], got_b[1]).item()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_window_dtype_round_trips(dtype) -> None:
    layer = RotatingKVCache(max_size=WINDOW)
    keys = _tokens(WINDOW + 3).astype(dtype)
    layer.update_and_fetch(keys, keys)
    restored = _round_trip([layer], WINDOW + 3, kv_codec.snapshot([layer]), [RotatingKVCache(8)])
    assert restored[0].keys.dtype == dtype
    assert mx.array_equal(restored[0].keys, layer.keys).item()


def test_a_window_that_does_not_fit_is_refused() -> None:
    layer = RotatingKVCache(max_size=WINDOW)
    _feed([layer], [10])
    block = kv_codec.block_tensors([layer], 0, 10, kv_codec.snapshot([layer]))
    with pytest.raises(ValueError, match="window"):
        kv_codec.restore([RotatingKVCache(max_size=2 * WINDOW)], [block], 10)
    # The blocks say 12 tokens, the window ends at 10: never serve that state.
    with pytest.raises(ValueError, match="ends at token 10"):
        kv_codec.restore([RotatingKVCache(max_size=WINDOW)], [block], 12)


def test_a_window_block_needs_a_snapshot() -> None:
    layer = RotatingKVCache(max_size=WINDOW)
    _feed([layer], [10])
    with pytest.raises(ValueError, match="snapshot"):
        kv_codec.block_tensors([layer], 0, 10, None)


def test_a_state_layer_of_the_image_path_round_trips_as_an_arrays_cache() -> None:
    # The image path's StateCache (mlx-lm's ArraysCache with mlx-vlm's writes) is
    # snapshotted, stored and restored as an ArraysCache, into the template's class.
    layer = StateCache(2)
    layer[0], layer[1] = mx.ones((1, 3, 8)), mx.arange(16.0).reshape(1, 2, 8)
    state = kv_codec.snapshot([layer])
    layer[1] = mx.zeros((1, 2, 8))  # a later step: the snapshot keeps the boundary's
    assert kv_codec.layer_layout([layer]) == ("arrays:2",)
    block = kv_codec.block_tensors([layer], 0, 4, state)
    restored = kv_codec.restore([StateCache(2)], [block], 4)[0]
    assert type(restored) is StateCache
    assert mx.array_equal(restored[1], mx.arange(16.0).reshape(1, 2, 8)).item()
    assert mx.array_equal(restored[0], mx.ones((1, 3, 8))).item()


@pytest.mark.parametrize("cut", [3, WINDOW, WINDOW + 5, 2 * WINDOW + 3])
def test_a_window_one_forward_filled_cut_back_continues_as_if_fed_only_that_far(cut: int) -> None:
    """A whole-prompt prefill (one forward from token 0) takes its block snapshots
    afterwards (kv_codec.held_at): the window cut back to token ``cut`` then answers
    the next updates as a window fed only that far, through a block round trip."""
    keys = _tokens(3 * WINDOW)
    filled, fed = [KVCache(), RotatingKVCache(max_size=WINDOW)], RotatingKVCache(max_size=WINDOW)
    for layer in filled:
        layer.update_and_fetch(keys, keys * 2)
    fed.update_and_fetch(keys[..., :cut, :], keys[..., :cut, :] * 2)
    held = kv_codec.held_at(filled, cut)
    assert held is not None and held[0] is filled[0]
    block = kv_codec.block_tensors(held, 0, cut, kv_codec.snapshot(held))
    template = [KVCache(), RotatingKVCache(max_size=WINDOW)]
    restored = kv_codec.restore(template, [block], cut)[1]
    for n in [1, 3, 1, 1]:
        more = _tokens(n)
        got, want = restored.update_and_fetch(more, more), fed.update_and_fetch(more, more)
        assert mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1], want[1]).item()


def test_only_a_window_one_forward_filled_can_be_cut_back() -> None:
    chunked, kept = RotatingKVCache(max_size=WINDOW), RotatingKVCache(max_size=WINDOW, keep=2)
    _feed([chunked], [6, 6, 6])  # the third chunk trimmed the first
    _feed([kept], [12])
    state = StateCache(2)
    assert kv_codec.held_at([chunked], 4) is None
    assert kv_codec.held_at([kept], 4) is None
    assert kv_codec.held_at([KVCache(), state], 4) is None
    assert kv_codec.held_at([RotatingKVCache(max_size=WINDOW)], 4) is None  # empty
