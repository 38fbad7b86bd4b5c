"""The KV-capacity auto-profile at model load (seed 002), with real models.

The profile measures a full prefill chunk, the batched prefill of several rows
and a full decode batch on the loaded model, validates with the chosen KV and a
canary held, and turns what it measured into the model's ``max_kv_tokens``; an
explicit ``max_kv_tokens`` gets one pass of every step beside its KV. Capacity
then admits (queues) and refuses prompts by their KV.
"""

from __future__ import annotations

import asyncio

import psutil
import pytest

from omlx.engine import profile as profile_module
from omlx.errors import InsufficientMemoryError, PrefillMemoryExceededError
from omlx.memory.budget import Limits, MemoryReading, canary_bytes, kv_capacity_tokens
from omlx.memory.guard import MemoryGuard
from omlx.memory.probe import MemoryProbe
from omlx.scheduler import Request, SamplingParams
from tests.integration.test_memory_admission import generate

MB = 1_000_000


def _capacity(guard: MemoryGuard, attempt: int) -> int:
    """The capacity the guard's measured profile implies under its own (auto) margin."""
    assert guard.profile is not None
    return kv_capacity_tokens(
        guard.limits,
        guard.dims,
        baseline_bytes=guard.baseline_bytes,
        chunk_tokens=guard.chunk_tokens,
        overhead_bytes=guard.profile.overhead_bytes,
        unmodeled_bytes=guard.unmodeled_bytes,
        canary_bytes=canary_bytes(guard.limits),
        attempt=attempt,
    )


def test_load_measures_a_capacity_the_admin_api_shows(make_pool) -> None:
    pool = make_pool(fresh_profile=True, max_concurrent_requests=4, prefill_step_size=256)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        profile = engine.guard.profile
        assert profile is not None and profile.source == "measured"
        assert 1 <= profile.attempts <= 4
        # A real chunk of a real model allocates more than its KV (activations, scores).
        assert profile.prefill_peak_bytes > engine.guard.dims.kv_bytes_per_token * 256
        assert profile.overhead_bytes > 0
        expected = _capacity(engine.guard, profile.attempts - 1)
        assert engine.guard.max_kv_tokens == expected > 256
        assert "max_kv_tokens" in engine.guard.describe()
        status = {m["name"]: m for m in pool.status()}
        shown = status["tiny-llama"]["kv_profile"]
        assert shown["source"] == "measured" and shown["max_kv_tokens"] == expected
        assert status["tiny-qwen3"]["kv_profile"] is None  # not loaded

    asyncio.run(main())


def test_capacity_follows_the_limits_in_force(make_pool) -> None:
    pool = make_pool(fresh_profile=True, prefill_step_size=256)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        before = engine.guard.max_kv_tokens
        lower = Limits(pool.limits.hard_bytes // 2, pool.limits.soft_bytes // 2, 0)
        engine.guard.publish(lower)
        assert engine.guard.max_kv_tokens < before

    asyncio.run(main())


def test_explicit_max_kv_tokens_keeps_one_stress_pass(make_pool) -> None:
    pool = make_pool(fresh_profile=True, memory={"max_kv_tokens": 5000}, prefill_step_size=256)
    pool.model_settings.update("tiny-qwen3", {"max_kv_tokens": 700})

    async def main() -> None:
        llama = await pool.get_engine("tiny-llama")
        qwen = await pool.get_engine("tiny-qwen3")
        assert llama.guard.profile.source == "explicit"
        assert llama.guard.max_kv_tokens == 5000  # the global setting
        assert qwen.guard.max_kv_tokens == 700  # the model's own wins
        # The safety net (seed 002): one pass of every step beside the pinned KV,
        # really allocated, and the transient it measured.
        profile = qwen.guard.profile
        assert profile.source == "explicit" and profile.attempts == 1
        # Its 700 tokens in flight: held beside the batched step, which adds its rows' own.
        held_tokens = profile.held_kv_bytes // qwen.guard.dims.kv_bytes_per_token
        assert profile.batch_rows == 2 and held_tokens + 2 * 256 == 700
        assert profile.overhead_bytes > 0
        # Nothing measured sets the margin: the unmeasured default stays.
        assert qwen.guard.limits.transient_margin_bytes == pool.limits.transient_margin_bytes

    asyncio.run(main())


def test_an_explicit_capacity_too_large_for_the_limit_fails_the_load(make_pool) -> None:
    # Room for the weights and one step, not for 4096 tokens of slow-llama's KV (64 MB).
    hard = psutil.Process().memory_info().rss + 40 * MB
    pool = make_pool(
        fresh_profile=True,
        memory={"max_process_memory": hard, "max_kv_tokens": 100_000},
        prefill_step_size=256,
    )

    async def main() -> None:
        with pytest.raises(InsufficientMemoryError) as info:
            await pool.get_engine("slow-llama")
        message = str(info.value)
        assert "max_kv_tokens 100000 does not fit" in message
        fits = int(message.split("about ")[1].split(" KV tokens would fit")[0])
        assert 0 <= fits < 100_000
        assert "memory.max_process_memory" in message
        assert info.value.http_status == 507
        assert pool.loaded() == []

    asyncio.run(main())


def test_the_batched_prefill_is_stressed_at_max_concurrent_requests_rows(
    make_pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Time out of the picture: how many rows the budget affords depends on the host's
    # speed at that moment; this test is about what eight rows' pass is counted for.
    monkeypatch.setattr(profile_module, "BATCH_STRESS_BUDGET_S", 60.0)
    pool = make_pool(fresh_profile=True, max_concurrent_requests=8, prefill_step_size=256)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        profile, kv = engine.guard.profile, engine.guard.dims.kv_bytes_per_token
        assert profile.batch_rows == 8  # max_concurrent_requests, all within the budget
        batch_over = profile.batch_peak_bytes - kv * 8 * 256
        solo_over = profile.prefill_peak_bytes - kv * 256
        # Eight rows' activations at once, not one: the capacity and margin count them.
        assert batch_over > 2 * solo_over
        assert profile.overhead_bytes >= batch_over
        assert engine.guard.max_kv_tokens == _capacity(engine.guard, profile.attempts - 1)

    asyncio.run(main())


def test_prompts_queue_by_kv_capacity_and_all_complete(make_pool) -> None:
    pool = make_pool(fresh_profile=True, max_concurrent_requests=4, prefill_step_size=256)
    # Room for one 600-token request's KV at a time (prompt + 8 new tokens), not two.
    pool.model_settings.update("slow-llama", {"max_kv_tokens": 1000})
    prompts = [[5 + (i * 11 + j) % 300 for j in range(600)] for i in range(3)]

    async def main() -> None:
        engine = await pool.get_engine("slow-llama")
        solo = [await generate(engine, f"solo-{i}", p, 8) for i, p in enumerate(prompts)]
        together = await asyncio.gather(
            *(generate(engine, f"c-{i}", p, 8) for i, p in enumerate(prompts))
        )
        assert together == solo
        assert engine.num_deferrals >= 2  # the second and third waited their turn
        assert engine.num_gated == 0

    asyncio.run(main())


def test_a_prompt_over_capacity_is_refused_at_the_front_door(make_pool) -> None:
    pool = make_pool(fresh_profile=True)
    pool.model_settings.update("tiny-llama", {"max_kv_tokens": 300})

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        request = Request("big", tuple(range(5, 306)), SamplingParams(max_tokens=2))
        with pytest.raises(PrefillMemoryExceededError, match="300 tokens") as info:
            engine.submit(request, None)  # type: ignore[arg-type]
        assert info.value.http_status == 400
        assert engine.num_in_flight == 0 and not engine.finish_counts
        ok = await generate(engine, "fits", list(range(5, 305)), 2)
        assert ok[0] == "length"

    asyncio.run(main())


def test_no_room_for_one_chunk_fails_the_load_naming_every_knob(make_pool) -> None:
    # A ceiling a few MB above this process: the weights fit, a prefill chunk does not.
    hard = psutil.Process().memory_info().rss + 4 * MB
    pool = make_pool(
        fresh_profile=True,
        memory={"max_process_memory": hard, "prefill_transient_margin": "1MB"},
        prefill_step_size=512,
    )

    async def main() -> None:
        with pytest.raises(InsufficientMemoryError) as info:
            await pool.get_engine("slow-llama")
        message = str(info.value)
        for knob in (
            "max_process_memory",
            "prefill_step_size",
            "max_concurrent_requests",
            "max_kv_tokens",
            "smaller",
        ):
            assert knob in message
        assert info.value.http_status == 507
        assert pool.loaded() == []

    asyncio.run(main())


class SpikyProbe(MemoryProbe):
    """The real probe, plus another allocation that shows up while chosen stress
    passes run (numbered by ``watched_peak`` calls: 1 prefill, 2 decode, 3 the
    batched prefill, 4+ validations)."""

    def __init__(self, spikes: dict[int, int]) -> None:
        super().__init__()
        self.spikes = spikes
        self.calls = 0

    def watched_peak(self) -> tuple[int, MemoryReading]:
        peak, reading = super().watched_peak()
        self.calls += 1
        return peak + self.spikes.get(self.calls, 0), reading


def test_a_failed_validation_shrinks_capacity_by_five_percent(make_pool) -> None:
    pool = make_pool(fresh_profile=True, prefill_step_size=256)
    # The first validation peaks over the hard limit.
    probe = pool.probe = SpikyProbe({4: pool.limits.hard_bytes})

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        profile = engine.guard.profile
        assert profile.attempts == 2
        assert engine.guard.max_kv_tokens == _capacity(engine.guard, 1)
        assert probe.calls == 5

    asyncio.run(main())


def test_validation_failing_every_retry_fails_the_load(make_pool) -> None:
    pool = make_pool(fresh_profile=True, prefill_step_size=256)
    # Every validation peaks over the hard limit: 1 try + 3 retries, then give up.
    probe = pool.probe = SpikyProbe({n: pool.limits.hard_bytes for n in range(4, 10)})

    async def main() -> None:
        with pytest.raises(InsufficientMemoryError, match="max_kv_tokens"):
            await pool.get_engine("tiny-llama")
        assert probe.calls == 3 + 4
        assert pool.loaded() == []

    asyncio.run(main())


def test_a_slow_row_stresses_fewer_rows_within_the_time_budget() -> None:
    """The batched pass runs as many rows as the budget affords at the measured
    one-row speed (none when two would not fit): the load stays quick."""
    stress = profile_module._Stress(None, vocab_size=100, chunk_tokens=256, batch_size=8)
    budget = profile_module.BATCH_STRESS_BUDGET_S
    for row_seconds, rows in ((budget / 10, 8), (budget / 3, 3), (budget / 1.5, 0)):
        stress.row_seconds = row_seconds
        assert stress.batch_rows(stress.batch) == rows
    stress.row_seconds = budget / 10
    assert stress.batch_rows(5) == 5  # never more than the KV held affords
