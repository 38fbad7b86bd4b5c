"""The prefix cache of a model with a quantized KV cache (``kv_bits``, issue 41), on
the tiny slow-llama (heads of 64: groups of 32 split them) served by the engine.

Its blocks are quantized KV (kv_codec's ``quantized:<bits>:<group>`` kind, in the
layout): the same model served with full-precision KV, then with 8-bit KV (a settings
change and a reload), never serves one's blocks to the other, from the RAM tier or,
after a restart, the SSD tier (whose files name their layout); a second request with
8-bit KV hits and answers as it did uncached.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
from mlx_lm import load

from omlx.cache import kv_codec
from omlx.engine.model_engine import ModelEngine
from omlx.engine.quantized_cache import QuantizedLayer, install
from omlx.mlx_types import prompt_cache
from omlx.models.model_settings import KVQuantSpec
from tests.integration.test_prefix_cache import settle
from tests.integration.test_prefix_cache_lists import generate

MODEL = "slow-llama"
BLOCK = 16
CACHE = {"enabled": True, "block_size": BLOCK, "hot_cache_max_size": "256MB"}
TEXT = (
    "The memory of the machine is shared between the processor and the graphics unit. "
    "When one request fills it, every other program on the machine feels it. "
) * 2


async def _served(engine: ModelEngine, prompt: list[int]) -> tuple[tuple[str, int], int]:
    answer = await generate(engine, prompt)
    await settle(engine)
    return answer


async def _reload(pool, kv_bits: int | None) -> ModelEngine:
    pool.model_settings.put(MODEL, {"kv_bits": kv_bits})
    await pool.unload(MODEL)
    return await pool.get_engine(MODEL)


def test_full_and_8_bit_kv_never_share_blocks_and_an_8_bit_hit_answers_as_uncached(
    make_pool,
) -> None:
    async def first_run() -> tuple[list[int], tuple[str, int]]:
        pool = make_pool(cache=CACHE, prefill_step_size=32)
        engine = await pool.get_engine(MODEL)
        prompt = list(engine.tokenizer.encode(TEXT))
        assert len(prompt) > 6 * BLOCK
        assert engine.prefix_cache is not None and engine.prefix_cache.layout[0] == "kv"
        assert (await _served(engine, prompt))[1] == 0
        assert (await _served(engine, prompt))[1] == len(prompt) - 1  # full blocks held
        engine = await _reload(pool, 8)
        assert engine.prefix_cache is not None
        assert set(engine.prefix_cache.layout) == {"quantized:8:32"}
        uncached, cached = await _served(engine, prompt)
        assert cached == 0  # the full-precision blocks in RAM are not its
        assert await _served(engine, prompt) == (uncached, len(prompt) - 1)
        await pool.close()  # write-back: the RAM blocks go to the SSD
        return prompt, uncached

    prompt, uncached = asyncio.run(first_run())

    async def restart() -> None:
        pool = make_pool(cache=CACHE, prefill_step_size=32)
        pool.model_settings.put(MODEL, {"kv_bits": 8})
        engine = await pool.get_engine(MODEL)
        assert await _served(engine, prompt) == (uncached, len(prompt) - 1)
        assert engine.prefix_cache is not None
        assert engine.prefix_cache.stats()["ssd"]["hits"] > 0
        # Full precision again: the SSD holds 8-bit blocks only, which it must not serve.
        engine = await _reload(pool, None)
        assert (await _served(engine, prompt))[1] == 0
        await pool.close()

    asyncio.run(restart())


def test_8_bit_blocks_restore_into_the_models_own_layers(tiny_models_dir) -> None:
    """Blocks cut from a prefilled 8-bit cache restore into what the model's
    ``make_cache`` makes (omlx's quantized layers, which batch), and the next forward
    over them equals the next forward over the cache they were cut from."""
    model, tokenizer = load(str(tiny_models_dir / MODEL))
    install(model, KVQuantSpec(8, 64), MODEL)
    prompt = list(tokenizer.encode(TEXT))[: 3 * BLOCK]
    held = prompt_cache(model)
    model(mx.array(prompt)[None], cache=held)
    blocks = [
        kv_codec.block_tensors(held, start, start + BLOCK, None)
        for start in range(0, len(prompt), BLOCK)
    ]
    restored = kv_codec.restore(prompt_cache(model), blocks, len(prompt))
    assert all(type(layer) is QuantizedLayer for layer in restored)
    nxt = mx.array([[prompt[-1]]])
    assert mx.array_equal(model(nxt, cache=restored), model(nxt, cache=held))


def test_8_bit_hits_of_requests_that_arrive_together_answer_as_each_alone(make_pool) -> None:
    """Four prompts sharing a cached opening, at once: each restores it (quantized
    layers) and joins the batch (a BatchQuantizedKVCache) with its answer alone."""
    pool = make_pool(cache=CACHE, prefill_step_size=32)
    pool.model_settings.put(MODEL, {"kv_bits": 8})

    async def main() -> None:
        engine = await pool.get_engine(MODEL)
        assert engine.prefix_cache is not None
        shared = list(engine.tokenizer.encode(TEXT))
        prompts = [shared + list(engine.tokenizer.encode(f" Question {i}?")) for i in range(4)]
        alone = []
        for prompt in prompts:  # each computed from nothing
            engine.prefix_cache.clear("both")
            answer, cached = await _served(engine, prompt)
            assert cached == 0
            alone.append(answer)
        engine.prefix_cache.clear("both")
        await _served(engine, shared)
        together = await asyncio.gather(*(generate(engine, p) for p in prompts))
        assert [answer for answer, _ in together] == alone
        assert all(cached >= len(shared) // BLOCK * BLOCK for _, cached in together)

    asyncio.run(main())
