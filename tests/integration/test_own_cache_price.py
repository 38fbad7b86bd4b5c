"""The memory guard's price of a token for the own-cache families (issue 41) is what
their caches really grow by. GLM-5-Next keeps mlx-vlm's own CacheList per
sparse-attention layer (latent KV, the indexer's keys, a PoolingCache of its pooled keys,
and K/V its prefill forwards project, made only by a forward longer than mlx-vlm's
DECODE_BLOCK_SIZE), an ArraysCache per linear-attention layer; DeepSeek-V4.1 one
DeepseekV41Cache for every layer (windows, compressed groups, the indexer's keys)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from omlx.engine.engine_status import engine_status
from tests.fixtures.tiny_vlms import build_tiny_vlm
from tests.integration.test_memory_admission import generate
from tests.integration.test_own_cache import filled

MODEL = "tiny-glm5-next"
DEEPSEEK = "tiny-deepseek-v41"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("own-cache-price")
    build_tiny_vlm(root / MODEL, "glm5_next", seed=7, image_size=112)
    build_tiny_vlm(root / DEEPSEEK, "deepseek_v41", seed=7, image_size=56)
    return root


def held_bytes(cache: list[Any]) -> int:
    """The bytes of every buffer a GLM-5-Next cache holds: each CacheList's KVCaches'
    keys and values and its PoolingCache's pooled keys and window buffers; each
    ArraysCache's states."""
    total = 0
    for layer in cache:
        for part in getattr(layer, "caches", [layer]):
            names = ("keys", "values", "pooled", "buf_kv", "buf_gate")
            arrays = [getattr(part, name, None) for name in names]
            arrays += list(getattr(part, "cache", None) or [])
            total += sum(a.nbytes for a in arrays if a is not None)
    return total


def test_the_guard_prices_a_glm5_next_token_by_what_its_cache_grows_by(make_pool, models) -> None:
    """The guard's KV per token is what a prompt's token adds to every buffer of the
    model's own cache (its projected K/V too, which a forward of 8 tokens never makes),
    one request at a time."""
    pool = make_pool(models, max_concurrent_requests=4)

    async def main() -> None:
        engine = await pool.get_engine(MODEL)
        model = engine._runner._model
        cache = filled(model, 44)
        assert [type(c).__name__ for c in cache] == ["ArraysCache", "CacheList"] * 2
        assert type(cache[1].caches[2]).__name__ == "PoolingCache"
        # The premise: a prefill forward made the projected K/V, a short one does not.
        assert cache[1].caches[3].keys is not None
        assert filled(model, 8)[1].caches[3].keys is None
        # Two lengths a KVCache step (256 columns) and 64 pools of 4 apart.
        grown = held_bytes(filled(model, 300)) - held_bytes(cache)
        assert engine.guard.dims.measured_kv_bytes_per_token == grown // 256
        batching = engine_status(engine)["batching"]
        assert batching["one_at_a_time"] and "PoolingCache" in batching["reason"]
        assert (await generate(engine, "fits", [5 + j % 400 for j in range(40)]))[0] == "length"

    asyncio.run(main())


def every_array_bytes(tree: Any, seen: set[int]) -> int:
    """The bytes of every array an object holds in its attributes and lists, once each."""
    if id(tree) in seen:
        return 0
    seen.add(id(tree))
    if isinstance(tree, mx.array):
        return int(tree.nbytes)
    parts = tree if isinstance(tree, list) else list(getattr(tree, "__dict__", {}).values())
    return sum(every_array_bytes(part, seen) for part in parts)


def test_the_guard_prices_a_deepseek_v41_token_by_what_its_cache_grows_by(
    make_pool, models
) -> None:
    """A DeepseekV41Cache grows by the same bytes a token over longer prompts than the
    guard's probes (its compressed groups, the indexer's keys and picks): the guard's
    price is that growth."""
    pool = make_pool(models, max_concurrent_requests=4)

    async def main() -> None:
        engine = await pool.get_engine(DEEPSEEK)
        model = engine._runner._model
        assert [type(c).__name__ for c in model.make_cache()] == ["DeepseekV41Cache"]
        # 296 and 552 tokens: a step of its 256-row buffers and 64 groups of 4 apart.
        grown = every_array_bytes(filled(model, 552), set())
        grown -= every_array_bytes(filled(model, 296), set())
        assert engine.guard.dims.measured_kv_bytes_per_token == grown // 256 > 0
        batching = engine_status(engine)["batching"]
        assert batching["one_at_a_time"] and "DeepseekV41Cache" in batching["reason"]
        assert (await generate(engine, "fits", [5 + j % 400 for j in range(40)]))[0] == "length"

    asyncio.run(main())
