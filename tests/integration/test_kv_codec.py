"""Cache layers -> block bytes -> cache layers gives the very same next logits."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from omlx.cache import kv_codec
from omlx.cache.kv_bytes import cut_payload
from omlx.cache.safetensors_io import BlockPayload
from tests.fixtures.tiny_models import build_tiny_model

BLOCK = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("codec-models")
    out = {}
    for name, arch, seed in [
        ("llama", "llama", 0),
        ("lfm2", "lfm2", 3),
        ("gemma3", "gemma3_text", 4),
    ]:
        model, tokenizer = mlx_lm.load(str(build_tiny_model(root / name, arch, seed=seed)))
        out[name] = (model, tokenizer)
    return out


def _prefill_in_blocks(model, ids: list[int], num_blocks: int):
    """Prefill block by block, keeping each block's tensors as the prefix cache would."""
    cache = make_prompt_cache(model)
    blocks = []
    for i in range(num_blocks):
        model(mx.array(ids[i * BLOCK : (i + 1) * BLOCK])[None], cache=cache)
        state = kv_codec.snapshot(cache)
        blocks.append(kv_codec.block_tensors(cache, i * BLOCK, (i + 1) * BLOCK, state))
    return cache, blocks


# gemma3's 32-token sliding windows wrap within the 4 blocks.
@pytest.mark.parametrize("name", ["llama", "lfm2", "gemma3"])
def test_restored_cache_continues_exactly(models, name: str) -> None:
    model, tokenizer = models[name]
    ids = tokenizer.encode("Memory is shared by the processor and the graphics unit. " * 4)
    assert len(ids) > 5 * BLOCK
    cache, blocks = _prefill_in_blocks(model, ids, 4)
    rest = mx.array(ids[4 * BLOCK : 4 * BLOCK + 8])[None]
    expected = model(rest, cache=cache)
    restored = kv_codec.restore(make_prompt_cache(model), blocks)
    assert restored[-1].offset == 4 * BLOCK
    got = model(rest, cache=restored)
    assert mx.allclose(got, expected, atol=1e-5).item()


def test_recurrent_state_comes_from_the_last_block(models) -> None:
    """A hybrid model's restored state is the one at the end of the prefix; the
    state of an earlier boundary gives other logits (so the check above can fail)."""
    model, tokenizer = models["lfm2"]
    ids = tokenizer.encode("Memory is shared by the processor and the graphics unit. " * 4)
    cache, blocks = _prefill_in_blocks(model, ids, 4)
    rest = mx.array(ids[4 * BLOCK : 4 * BLOCK + 8])[None]
    expected = model(rest, cache=cache)
    stale = {k: v for k, v in blocks[0].items() if ".state." in k}
    wrong = kv_codec.restore(make_prompt_cache(model), [*blocks[:3], {**blocks[3], **stale}])
    assert not mx.allclose(model(rest, cache=wrong), expected, atol=1e-3).item()


def test_layouts(models) -> None:
    llama, _ = models["llama"]
    lfm2, _ = models["lfm2"]
    assert kv_codec.layer_layout(make_prompt_cache(llama)) == ("kv", "kv")
    layout = kv_codec.layer_layout(make_prompt_cache(lfm2))
    assert layout == ("arrays:1", "kv", "arrays:1", "kv")
    assert kv_codec.is_sliceable(("kv", "kv")) and not kv_codec.is_sliceable(layout)
    gemma3, _ = models["gemma3"]
    layout = kv_codec.layer_layout(make_prompt_cache(gemma3))
    assert layout == ("rotating:32:0", "kv", "rotating:32:0", "kv")
    assert not kv_codec.is_sliceable(layout)


def test_layouts_of_chunked_quantized_and_listed_caches() -> None:
    from mlx_lm.models.cache import (
        ArraysCache,
        CacheList,
        ChunkedKVCache,
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
    )

    layout = kv_codec.layer_layout(
        [
            ChunkedKVCache(chunk_size=8),
            QuantizedKVCache(group_size=32, bits=4),
            CacheList(ArraysCache(2), RotatingKVCache(max_size=16)),
            CacheList(KVCache(), KVCache()),
        ]
    )
    assert layout == ("chunked:8", "quantized:4:32", "list[arrays:2,rotating:16:0]", "list[kv,kv]")
    assert kv_codec.quantized_kind(4, 32) == "quantized:4:32"
    assert kv_codec.is_sliceable(("kv", "quantized:8:64", "list[kv,kv]"))
    assert not kv_codec.is_sliceable(("kv", "list[arrays:2,kv]"))
    assert not kv_codec.is_sliceable(("chunked:8", "kv"))


def test_unsupported_cache_types_are_refused() -> None:
    # mlx-lm's own ConcatenateKVCache (no model makes it) is not stored, nor a list holding one.
    from mlx_lm.models.cache import CacheList, ConcatenateKVCache, KVCache

    assert kv_codec.layer_layout([KVCache(), ConcatenateKVCache()]) is None
    assert kv_codec.layer_layout([CacheList(KVCache(), ConcatenateKVCache())]) is None
    # What the log names when the prefix cache stays off.
    assert kv_codec.unstorable([CacheList(KVCache(), ConcatenateKVCache())]) == [
        "ConcatenateKVCache"
    ]


@pytest.mark.parametrize("chunk", [24, 32])
def test_chunked_layers_restore_at_every_block_end(tmp_path, chunk: int) -> None:
    """llama4's chunked layers: a chunk that is not a multiple of the block (24) has
    blocks spanning two chunks; each block end restores to the logits of the prefix
    computed at once."""
    model, tokenizer = mlx_lm.load(str(_llama4(tmp_path, chunk)))
    ids = tokenizer.encode("Memory is shared by the processor and the graphics unit. " * 6)
    cache = make_prompt_cache(model)
    blocks = []
    for i in range(6):
        model(mx.array(ids[i * BLOCK : (i + 1) * BLOCK])[None], cache=cache)
        state = kv_codec.snapshot(cache, i * BLOCK)
        blocks.append(kv_codec.block_tensors(cache, i * BLOCK, (i + 1) * BLOCK, state))
    for n in range(1, 7):
        rest = mx.array(ids[n * BLOCK : n * BLOCK + 8])[None]
        fresh = make_prompt_cache(model)
        model(mx.array(ids[: n * BLOCK])[None], cache=fresh)
        expected = model(rest, cache=fresh)
        restored = kv_codec.restore(make_prompt_cache(model), blocks[:n], n * BLOCK)
        assert restored[0].start_position == n * BLOCK // chunk * chunk
        assert mx.allclose(model(rest, cache=restored), expected, atol=1e-5).item()
    # A block missing (its KV layers would hold fewer tokens than the chunked ones):
    # refused, never served.
    with pytest.raises(ValueError, match="chunk ends at token 96, blocks hold 80"):
        kv_codec.restore(make_prompt_cache(model), [*blocks[:4], blocks[5]], 5 * BLOCK)


def _llama4(tmp_path, chunk: int):
    from tests.fixtures.tiny_models import ARCH_CONFIGS

    text_config = {**ARCH_CONFIGS["llama4"]["text_config"], "attention_chunk_size": chunk}
    return build_tiny_model(tmp_path / f"llama4-{chunk}", "llama4", text_config=text_config)


def test_quantized_kv_round_trips_and_cuts() -> None:
    from mlx_lm.models.cache import QuantizedKVCache

    layer = QuantizedKVCache(group_size=32, bits=8)
    keys = mx.random.normal((1, 2, 2 * BLOCK, 64))
    layer.update_and_fetch(keys, keys * 2)
    blocks = [kv_codec.block_tensors([layer], i * BLOCK, (i + 1) * BLOCK, None) for i in (0, 1)]
    restored = kv_codec.restore([QuantizedKVCache(group_size=32, bits=8)], blocks)[0]
    assert restored.offset == 2 * BLOCK
    for got, held in zip(restored.keys_and_values(), layer.keys_and_values(), strict=True):
        assert all(mx.array_equal(g, h).item() for g, h in zip(got, held, strict=True))
    # Room for the next tokens, as for plain KV.
    assert restored.keys[0].shape[2] % QuantizedKVCache.step == 0
    payload = BlockPayload("ab" * 8, "m", BLOCK, BLOCK, ("quantized:8:32",), blocks[1])
    cut = cut_payload(payload, 5)
    half = kv_codec.restore([QuantizedKVCache(group_size=32, bits=8)], [blocks[0], cut.tensors])[0]
    assert half.offset == BLOCK + 5
    got_keys, _ = half.keys_and_values()
    assert mx.array_equal(got_keys[0], layer.keys[0][..., : BLOCK + 5, :]).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_dtypes_round_trip(dtype) -> None:
    from mlx_lm.models.cache import KVCache

    layer = KVCache()
    keys = mx.random.normal((1, 2, BLOCK, 8)).astype(dtype)
    layer.update_and_fetch(keys, keys * 2)
    block = kv_codec.block_tensors([layer], 0, BLOCK, None)
    restored = kv_codec.restore([KVCache()], [block])[0]
    assert restored.keys.dtype == dtype
    assert restored.offset == BLOCK
    held_keys, held_values = restored.keys_and_values()
    assert mx.array_equal(held_keys, keys).item()
    assert mx.array_equal(held_values, keys * 2).item()
    # Room for the next tokens, so the first forward after a hit does not copy it all.
    assert restored.keys.shape[2] > BLOCK and restored.keys.shape[2] % KVCache.step == 0


def test_a_cache_restored_for_a_batch_has_no_room() -> None:
    # A batched request's cache is merged (copied) into the batch: zeros for room
    # would only cost time (~15 ms for a 25-token hit on SmolLM2, per request).
    from mlx_lm.models.cache import KVCache

    layer = KVCache()
    keys = mx.random.normal((1, 2, 2 * BLOCK, 8))
    layer.update_and_fetch(keys, keys + 1)
    blocks = [kv_codec.block_tensors([layer], i * BLOCK, (i + 1) * BLOCK, None) for i in (0, 1)]
    restored = kv_codec.restore([KVCache()], blocks, room=False)[0]
    assert restored.offset == 2 * BLOCK and restored.keys.shape[2] == 2 * BLOCK
    assert mx.array_equal(restored.keys, keys).item()
    assert mx.array_equal(restored.values, keys + 1).item()
    restored.update_and_fetch(keys[..., :1, :], keys[..., :1, :])  # and it still grows
    assert restored.offset == 2 * BLOCK + 1


def test_blocks_of_another_shape_are_refused_not_mixed() -> None:
    # A block from another layout (here: other heads) under the same key is an error
    # (the prefix cache serves a miss), never a cache of mixed rows.
    from mlx_lm.models.cache import KVCache

    def block(heads: int) -> kv_codec.Tensors:
        layer = KVCache()
        keys = mx.random.normal((1, heads, BLOCK, 8))
        layer.update_and_fetch(keys, keys)
        return kv_codec.block_tensors([layer], 0, BLOCK, None)

    with pytest.raises(ValueError, match="blocks disagree"):
        kv_codec.restore([KVCache()], [block(2), block(4)])
