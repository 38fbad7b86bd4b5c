"""Ollama's keep_alive in the engine pool: a per-model idle TTL over the settings."""

from __future__ import annotations

import asyncio
import math

from tests.integration.test_pool import run


def test_keep_alive_overrides_the_ttl_until_the_model_is_unloaded(make_pool):
    now = [1000.0]
    pool = make_pool(clock=lambda: now[0])

    async def main() -> None:
        pool.model_settings.put("tiny-llama", {"ttl_s": 60})
        await run(pool, "tiny-llama")
        assert pool.idle_expiry_s("tiny-llama") == 60
        pool.keep_alive("tiny-llama", 600.0)  # from now, past the model's 60 s
        now[0] += 100
        assert await pool.expire_idle() == []
        assert pool.idle_expiry_s("tiny-llama") == 500
        pool.keep_alive("tiny-llama", math.inf)  # negative keep_alive: never expires
        now[0] += 10**6
        assert await pool.expire_idle() == [] and pool.idle_expiry_s("tiny-llama") is None
        pool.keep_alive("tiny-llama", None)  # not sent: the model's ttl_s again
        now[0] += 61
        assert await pool.expire_idle() == ["tiny-llama"]
        # The override went with the engine: a reload starts from the settings.
        await run(pool, "tiny-llama")
        assert pool.idle_expiry_s("tiny-llama") == 60
        pool.keep_alive("tiny-llama", 0.0)  # unload once idle
        assert await pool.expire_idle() == ["tiny-llama"]
        pool.keep_alive("tiny-llama", 5.0)  # not loaded: nothing to keep
        assert pool.idle_expiry_s("tiny-llama") is None

    asyncio.run(main())


def test_pinned_models_stay_whatever_keep_alive_says(make_pool):
    pool = make_pool()

    async def main() -> None:
        pool.model_settings.put("tiny-llama", {"pinned": True})
        await run(pool, "tiny-llama")
        pool.keep_alive("tiny-llama", 0.0)
        assert await pool.expire_idle() == []
        assert pool.idle_expiry_s("tiny-llama") is None

    asyncio.run(main())
