"""A vision family whose language model keeps mlx-vlm's own cache class (issue 41:
minimax_m3_vl's MiniMaxM3KVCache, KV plus its block index's keys), served one request
at a time on the model's own cache: the memory guard prices that cache by what it
really holds, and a prompt too big for the ceiling is refused, not run."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from omlx.engine.engine_status import engine_status
from omlx.engine.stream import RequestStream
from omlx.errors import PrefillMemoryExceededError
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.tiny_vlms import build_tiny_vlm
from tests.integration.test_memory_admission import generate

MODEL = "tiny-minimax-m3-vl"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("own-cache")
    build_tiny_vlm(root / MODEL, "minimax_m3_vl", seed=7, image_size=112)
    return root


def held_bytes(cache: list[Any]) -> int:
    """The bytes of every K/V and index-key buffer a MiniMax M3 cache holds (its
    KVCache layers' keys and values; its sparse layers' KV and block-index keys)."""
    total = 0
    for layer in cache:
        kv = getattr(layer, "kv_cache", layer)
        total += kv.keys.nbytes + kv.values.nbytes
        index = getattr(layer, "index_keys", None)
        total += 0 if index is None else index.nbytes
    return total


def filled(model: Any, num_tokens: int) -> list[Any]:
    """A fresh cache of the model's own after a forward of ``num_tokens`` tokens."""
    cache = model.make_cache()
    mx.eval(model(mx.arange(1, num_tokens + 1).reshape(1, -1), cache=cache))
    return cache


def test_the_guard_prices_the_model_s_own_cache_by_what_it_holds(make_pool, models) -> None:
    """The guard's KV per token is the growth of every buffer the model's own cache
    holds (its sparse layer's KV and index keys too), one request at a time."""
    pool = make_pool(models, max_concurrent_requests=4)

    async def main() -> None:
        engine = await pool.get_engine(MODEL)
        model = engine._runner._model
        caches = [type(c).__name__ for c in model.make_cache()]
        assert caches == ["KVCache"] * 3 + ["MiniMaxM3KVCache"]
        # Two lengths a KVCache step (256 columns) apart: the growth of one step.
        grown = held_bytes(filled(model, 300)) - held_bytes(filled(model, 40))
        per_token = engine.guard.dims.measured_kv_bytes_per_token
        assert per_token == grown // 256
        # More than the plain KV layers alone (what a reader of K/V attributes sees).
        plain = sum(c.keys.nbytes + c.values.nbytes for c in filled(model, 40)[:3]) // 256
        assert per_token > plain * 4 // 3
        batching = engine_status(engine)["batching"]
        assert batching["one_at_a_time"] and "MiniMaxM3KVCache" in batching["reason"]
        assert (await generate(engine, "fits", [5 + j % 400 for j in range(40)]))[0] == "length"

    asyncio.run(main())


def test_a_prompt_too_big_for_the_ceiling_is_refused_not_run(make_pool, models) -> None:
    """Under a hard limit 8 MiB above the loaded model, a 3000-token prompt (its KV
    priced by the measured figure, its prefill's attention) cannot fit: the front door
    refuses it before any forward; a short prompt still runs."""
    pool = make_pool(models, max_concurrent_requests=4, prefill_step_size=512)

    async def main() -> None:
        engine = await pool.get_engine(MODEL)
        guard = engine.guard
        ceiling = guard.baseline_bytes + guard.limits.transient_margin_bytes + 8 * 2**20
        guard.publish(
            dataclasses.replace(guard.limits, hard_bytes=ceiling, soft_bytes=int(ceiling * 0.85))
        )
        stream = RequestStream("huge", asyncio.get_running_loop())
        huge = Request("huge", tuple(5 + j % 400 for j in range(3000)), SamplingParams(0.0))
        with pytest.raises(PrefillMemoryExceededError) as info:
            engine.submit(huge, stream)
        assert info.value.estimated_bytes > info.value.limit_bytes == ceiling
        assert info.value.estimated_bytes > 3000 * guard.dims.kv_bytes_per_token
        assert engine.num_in_flight == 0 and not engine.finish_counts and not engine.has_work
        now = engine.probe.reading(fresh=True).resident_bytes
        roomy = int(max(ceiling, now + guard.limits.transient_margin_bytes + 8 * 2**20) / 0.98)
        guard.publish(
            dataclasses.replace(guard.limits, hard_bytes=roomy, soft_bytes=int(roomy * 0.85))
        )
        assert (await generate(engine, "small", [10, 11, 12], 3))[0] == "length"

    asyncio.run(main())
