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

from omlx.engine import profile_stress
from omlx.errors import InsufficientMemoryError, PrefillMemoryExceededError
from omlx.memory.budget import (
    Limits,
    MemoryReading,
    canary_bytes,
    kv_capacity_tokens,
    measured_margin_bytes,
    prefill_step_transient_bytes,
)
from omlx.memory.guard import MemoryGuard
from omlx.memory.probe import MemoryProbe
from omlx.scheduler import Request, SamplingParams
from tests.integration.test_memory_admission import generate

MB = 1_000_000


def _capacity(guard: MemoryGuard, attempt: int) -> int:
    """The capacity the guard's measured profile implies under its own (auto) margin."""
    assert guard.profile is not None
    overhead, batch = guard.profile.capacity_terms()
    return kv_capacity_tokens(
        guard.limits,
        guard.dims,
        baseline_bytes=guard.baseline_bytes,
        chunk_tokens=guard.chunk_tokens,
        overhead_bytes=overhead,
        unmodeled_bytes=guard.unmodeled_bytes,
        canary_bytes=canary_bytes(guard.limits),
        attempt=attempt,
        batch=batch,
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


def test_explicit_max_kv_tokens_keeps_one_stress_pass(
    make_pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # However slow the model (every model, with no time budget), the one pass runs the
    # batched step: two rows, never none (issue 40, item 11).
    monkeypatch.setattr(profile_stress, "BATCH_STRESS_BUDGET_S", 0.0)
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
    monkeypatch.setattr(profile_stress, "BATCH_STRESS_BUDGET_S", 60.0)
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


def test_a_slow_model_has_its_widest_batch_extrapolated_counted_and_reported(
    make_pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model too slow for the time budget (every model, with no budget) measures two
    rows of the batched prefill, never none: the eight-row step the scheduler may run
    is extrapolated from them, counted in the capacity and margin, and reported."""
    monkeypatch.setattr(profile_stress, "BATCH_STRESS_BUDGET_S", 0.0)
    pool = make_pool(fresh_profile=True, max_concurrent_requests=8, prefill_step_size=256)
    spike = 40 * MB
    pool.probe = SpikyProbe({3: spike})  # the batched pass holds 40 MB more: 20 MB a row

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        profile, kv = engine.guard.profile, engine.guard.dims.kv_bytes_per_token
        assert (profile.batch_rows, profile.batch_rows_widest) == (2, 8)
        over = profile.batch_peak_bytes - kv * 2 * 256
        assert profile.batch_widest_peak_bytes == kv * 8 * 256 + -(-over * 8 // 2)
        assert profile.batch_widest_peak_bytes >= 4 * spike
        widest_over = profile.batch_widest_peak_bytes - kv * 8 * 256
        assert profile.overhead_bytes >= widest_over  # the capacity counts it
        # The margin covers one row's step; each admitted row brings what the formulas
        # miss of its share, so eight rows together are priced at least the widest's.
        guard = engine.guard
        assert guard.limits.transient_margin_bytes == measured_margin_bytes(
            profile.unbatched_overhead_bytes
        )
        assert guard.row_excess_bytes > 0
        per_row = prefill_step_transient_bytes(guard.dims, 256, 256) + guard.row_excess_bytes
        assert guard.limits.transient_margin_bytes + 8 * per_row >= widest_over
        assert engine.guard.max_kv_tokens == _capacity(engine.guard, profile.attempts - 1)
        assert "batched prefill 8 rows (extrapolated from 2 measured)" in engine.guard.describe()
        stress = pool.load_facts("tiny-llama")["profile_stress"]  # /health's model entry
        assert stress["batch_rows_measured"] == 2 and stress["batch_rows_widest"] == 8
        assert stress["batch_extrapolated"] is True
        assert stress["batch_widest_peak_bytes"] == profile.batch_widest_peak_bytes

    asyncio.run(main())


def test_a_chunk_over_a_long_context_is_measured_and_its_excess_priced(
    make_pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One chunk attending over four chunks of cached context is measured; what it holds
    beyond the formulas (here a 50 MB allocation during that pass) is added to every
    estimate, so the guard prices a long prompt's chunk by the worse of the two."""
    monkeypatch.setattr(profile_stress, "LONG_CONTEXT_BUDGET_S", 60.0)
    pool = make_pool(
        fresh_profile=True,
        max_concurrent_requests=4,
        prefill_step_size=256,
        memory={"prefill_transient_margin": "64MB"},
    )
    spike = 50 * MB
    pool.probe = SpikyProbe({4: spike})

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        profile, dims = engine.guard.profile, engine.guard.dims
        assert profile.long_context_tokens == 4 * 256
        estimate = profile_stress.long_context_estimate(dims, 256, 4 * 256)
        assert profile.long_context_estimate_bytes == estimate
        assert profile.long_context_peak_bytes >= spike
        excess = profile.long_context_peak_bytes - estimate
        # The margin is pinned: the excess is added to every estimate on its own.
        assert engine.guard.unmodeled_bytes == profile.unmodeled_bytes >= excess
        assert "a chunk over 1024 cached tokens measured" in engine.guard.describe()
        stress = pool.load_facts("tiny-llama")["profile_stress"]  # /health's model entry
        assert stress["long_context_tokens"] == 1024
        assert stress["long_context_peak_bytes"] == profile.long_context_peak_bytes

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
        # Counted as its cache holds it: its tokens plus mlx-lm's 256-column growth step
        # (memory/dims.allocated_columns), so 44 tokens fill the 300 and 45 pass them.
        request = Request("big", tuple(range(5, 5 + 45)), SamplingParams(max_tokens=2))
        with pytest.raises(PrefillMemoryExceededError, match=r"301 KV columns.*300 tokens") as info:
            engine.submit(request, None)  # type: ignore[arg-type]
        assert info.value.http_status == 400
        assert engine.num_in_flight == 0 and not engine.finish_counts
        ok = await generate(engine, "fits", list(range(5, 5 + 44)), 2)
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
    batched prefill, 4 the long-context chunk, 5+ validations)."""

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
    probe = pool.probe = SpikyProbe({5: pool.limits.hard_bytes})

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        profile = engine.guard.profile
        assert profile.attempts == 2
        assert engine.guard.max_kv_tokens == _capacity(engine.guard, 1)
        assert probe.calls == 6

    asyncio.run(main())


def test_validation_failing_every_retry_fails_the_load(make_pool) -> None:
    pool = make_pool(fresh_profile=True, prefill_step_size=256)
    # Every validation peaks over the hard limit: 1 try + 3 retries, then give up.
    probe = pool.probe = SpikyProbe({n: pool.limits.hard_bytes for n in range(5, 11)})

    async def main() -> None:
        with pytest.raises(InsufficientMemoryError, match="max_kv_tokens"):
            await pool.get_engine("tiny-llama")
        assert probe.calls == 4 + 4
        assert pool.loaded() == []

    asyncio.run(main())


def test_a_slow_row_measures_fewer_rows_within_the_time_budget_but_never_none() -> None:
    """The batched measurement runs as many rows as the budget affords at the measured
    one-row speed, and never fewer than two (the rest are extrapolated, not skipped);
    validation's batched step runs only what the budget affords."""
    stress = profile_stress.Stress(None, vocab_size=100, chunk_tokens=256, batch_size=8)
    budget = profile_stress.BATCH_STRESS_BUDGET_S
    for row_seconds, measured, validated in (
        (budget / 10, 8, 8),
        (budget / 3, 3, 3),
        (budget / 1.5, 2, 0),
        (budget * 100, 2, 0),
    ):
        stress.row_seconds = row_seconds
        assert stress.measured_rows(stress.batch) == measured
        assert stress.batch_rows(stress.batch) == validated
    stress.row_seconds = budget / 10
    assert stress.batch_rows(5) == stress.measured_rows(5) == 5  # never more than asked
    assert stress.measured_rows(1) == 0  # one request at a time: the solo pass is the batch
