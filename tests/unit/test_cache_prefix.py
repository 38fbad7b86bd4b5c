"""PrefixCache with sliding-window layers, on real mlx-lm caches and a real hot tier.

The engine prefills in block-aligned chunks with a snapshot at each boundary and
then decodes token by token, writing into the window in place; these replay that.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from omlx.cache import kv_codec
from omlx.cache import prefix_index as prefix_module
from omlx.cache.hot import HotTier
from omlx.cache.prefix import PrefixCache
from omlx.cache.prefix_index import NO_HIT, HitSpan, common_hit

BLOCK = 4
WINDOW = 6
_rng = np.random.default_rng(1)


def _layers() -> list:
    return [KVCache(), RotatingKVCache(max_size=WINDOW)]


def _prefix_cache() -> PrefixCache:
    layout = kv_codec.layer_layout(_layers())
    assert layout == ("kv", f"rotating:{WINDOW}:0")
    return PrefixCache("tiny@0", layout, BLOCK, HotTier(1 << 20, mode="hot-only"), None)


def _feed(layers: list, n: int) -> None:
    keys = mx.array(_rng.standard_normal((1, 2, n, 4)).astype(np.float32))
    for layer in layers:
        layer.update_and_fetch(keys, -keys)
    mx.eval([layer.keys for layer in layers])


def _window(layer: RotatingKVCache) -> tuple:
    keys, values, offset, keep, max_size, idx = layer.state
    return np.array(keys), np.array(values), (offset, keep, max_size, idx)


def _prefill(prefix: PrefixCache, rid: str, layers: list, num_tokens: int) -> dict[int, tuple]:
    """Block-aligned chunks with a snapshot at each boundary and before the last
    prompt token, as SoloSequence does; returns the window held at each."""
    held, pos = {}, 0
    while pos < num_tokens - 1:
        n = min(BLOCK - pos % BLOCK, num_tokens - 1 - pos)
        _feed(layers, n)
        pos += n
        prefix.snapshot(rid, pos, layers)
        held[pos] = _window(layers[1])
    return held


def _assert_window(layer: RotatingKVCache, held: tuple) -> None:
    keys, values, meta = _window(layer)
    assert meta == held[2]
    np.testing.assert_array_equal(keys, held[0])
    np.testing.assert_array_equal(values, held[1])


def test_a_hit_restores_the_window_of_its_last_block() -> None:
    prefix = _prefix_cache()
    tokens = list(range(100, 120))
    layers = _layers()
    held = _prefill(prefix, "a", layers, len(tokens))
    kv_keys = np.array(layers[0].keys[..., :19, :])
    for _ in range(5):  # decode: in-place writes into the window
        _feed(layers, 1)
    assert prefix.store("a", tokens, layers, 19, tail=True) == 5  # 4 blocks + the tail
    assert prefix.snapshot_positions("a") == []  # windows are large: released once stored

    hit = prefix.lookup(tokens, _layers())
    assert hit is not None and hit.num_tokens == 19
    _assert_window(hit.layers[1], held[19])
    np.testing.assert_array_equal(np.array(hit.layers[0].keys_and_values()[0]), kv_keys)

    # Another prompt sharing 3 blocks gets the window as it was at token 12.
    hit = prefix.lookup([*tokens[:13], 7, 7, 7, 7], _layers())
    assert hit is not None and hit.num_tokens == 12
    _assert_window(hit.layers[1], held[12])


def test_blocks_past_the_last_snapshot_are_not_stored() -> None:
    """Decoded tokens have no boundary snapshot: storing a leaving request keeps
    the prompt's blocks and never invents a window for the rest."""
    prefix = _prefix_cache()
    tokens = list(range(200, 222))
    layers = _layers()
    _prefill(prefix, "b", layers, 10)
    for _ in range(12):
        _feed(layers, 1)
    assert prefix.store("b", tokens, layers, 21, tail=True) == 2
    hit = prefix.lookup(tokens, _layers())
    assert hit is not None and hit.num_tokens == 8
    assert hit.layers[1].offset == 8


def test_a_prompt_sharing_part_of_a_stored_block_gets_those_tokens() -> None:
    """Token-granular reuse: a stored block (full or partial) serves the run of its
    first tokens that a new prompt repeats, cut to exactly that many."""
    layers = [KVCache(), KVCache()]
    prefix = PrefixCache("tiny@0", ("kv", "kv"), 16, HotTier(1 << 22, mode="hot-only"), None)
    stored = list(range(100, 140))  # 2 full blocks and an 8-token tail
    _feed(layers, len(stored))
    assert prefix.store("a", stored, layers, len(stored), tail=True) == 3
    keys = np.array(layers[0].keys[..., : len(stored), :])

    # Shares the first block and 11 tokens of the second.
    other = [*stored[:27], 7, 8, 9, 10]
    # The pure index (what admission asks) says what the lookup then restores.
    assert prefix.match(other) == 27 and prefix.match([*stored[:5], 1, 2, 3]) == 0
    hit = prefix.lookup(other, [KVCache(), KVCache()])
    assert hit is not None and hit.num_tokens == 27
    np.testing.assert_array_equal(np.array(hit.layers[0].keys[..., :27, :]), keys[..., :27, :])
    assert hit.layers[0].offset == 27

    # A shared run shorter than MIN_PARTIAL_TOKENS inside the first block is not worth it.
    assert prefix.lookup([*stored[:5], 1, 2, 3, 4, 5], [KVCache(), KVCache()]) is None
    # The run is capped by the prompt: its last token is never served.
    hit = prefix.lookup(stored[:12], [KVCache(), KVCache()])
    assert hit is not None and hit.num_tokens == 11


def test_token_granular_reuse_is_off_for_unsliceable_layouts(monkeypatch) -> None:
    monkeypatch.setattr(prefix_module, "MIN_PARTIAL_TOKENS", 1)
    prefix = _prefix_cache()
    layers = _layers()
    _prefill(prefix, "a", layers, 9)
    prefix.store("a", list(range(9)), layers, 8, tail=False)
    # 6 of the 8 stored tokens shared: the first block whole, but not 2 tokens of
    # the second (no snapshot there: the window at token 6 is unknown).
    hit = prefix.lookup([*list(range(6)), 50, 51, 52], _layers())
    assert hit is not None and hit.num_tokens == BLOCK


def test_ranks_agree_on_the_longest_hit_each_can_restore() -> None:
    """Sliceable KV cuts anywhere (step 1); window or recurrent state only at a block's
    end or at its stored tail. Ranks may even use other block sizes."""
    assert common_hit([HitSpan(1, 30, 30), HitSpan(16, 16, 20)]) == 20
    assert common_hit([HitSpan(16, 32, 40), HitSpan(16, 16, 20)]) == 16
    assert common_hit([HitSpan(16, 16, 20), HitSpan(16, 16, 20)]) == 20
    assert common_hit([HitSpan(16, 48, 48), HitSpan(24, 48, 50)]) == 48
    assert common_hit([HitSpan(16, 32, 32), HitSpan(24, 48, 48)]) == 0
    assert common_hit([HitSpan(1, 30, 30), NO_HIT]) == 0


def test_a_split_model_cuts_a_hit_to_a_length_every_rank_holds() -> None:
    """A window model's hit is cut at a block's end every rank holds, and restored with
    that block's window, not the longer hit's."""
    prefix = _prefix_cache()
    tokens = list(range(100, 120))
    layers = _layers()
    held = _prefill(prefix, "a", layers, len(tokens))
    kv_keys = np.array(layers[0].keys[..., :8, :])
    prefix.store("a", tokens, layers, 19, tail=True)
    other_rank = HitSpan(BLOCK, 8, 11)  # two whole blocks and a tail of its own
    seen: list[HitSpan] = []

    def agree(spans: list[HitSpan]) -> list[int]:
        seen.extend(spans)
        return [common_hit([span, other_rank]) for span in spans]

    (hit,) = prefix.lookup_together([tokens], _layers, room=True, agree=agree)
    assert seen == [HitSpan(BLOCK, 16, 19)]  # 4 whole blocks and the tail
    assert hit is not None and hit.num_tokens == 8
    _assert_window(hit.layers[1], held[8])
    np.testing.assert_array_equal(np.array(hit.layers[0].keys_and_values()[0]), kv_keys)
