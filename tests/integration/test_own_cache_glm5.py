"""GLM-5-Next on the own-cache path (issue 41): its language model keeps mlx-vlm's own
CacheList per sparse-attention layer (latent KV, the indexer's keys, a PoolingCache of
its pooled keys, and K/V its prefill forwards project, made only by a forward longer
than mlx-vlm's DECODE_BLOCK_SIZE), an ArraysCache per linear-attention layer. The memory
guard prices a token by what that cache really grows by."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from omlx.engine.engine_status import engine_status
from tests.fixtures.tiny_vlms import build_tiny_vlm
from tests.integration.test_memory_admission import generate

MODEL = "tiny-glm5-next"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("own-cache-glm5")
    build_tiny_vlm(root / MODEL, "glm5_next", seed=7, image_size=112)
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


def filled(model: Any, num_tokens: int) -> list[Any]:
    """A fresh cache of the model's own after a forward of ``num_tokens`` tokens."""
    cache = model.make_cache()
    mx.eval(model(mx.arange(1, num_tokens + 1).reshape(1, -1), cache=cache))
    return cache


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
