"""The front door and the KV capacity follow the live machine (issue 27, defect 2).

What a model's guard counts as resident with nothing in flight must move when
other models load and unload: a number frozen at the model's own load refused
prompts that fit once a co-resident model was unloaded (false 400), and let in
prompts the forward gate then ended (503 "retry shortly" that could never
succeed) once another model loaded.
"""

from __future__ import annotations

import asyncio

from omlx.errors import MemoryPressureError, PrefillMemoryExceededError
from omlx.memory.budget import Limits, canary_bytes, preflight
from tests.integration.test_memory_admission import generate

MB = 2**20
MARGIN = 8 * MB
PROMPT = [5 + (j * 7) % 400 for j in range(200)]


def _room_for_prompt(engine) -> int:
    """Bytes above the baseline the prompt needs at the front door (its peak
    estimate, plus what the KV capacity reserves beside it)."""
    guard = engine.guard
    roomy = Limits(2**40, 2**40, MARGIN)
    need = preflight(
        guard.dims,
        baseline_bytes=0,
        num_new_tokens=len(PROMPT),
        num_cached_tokens=0,
        chunk_tokens=guard.chunk_tokens,
        limits=roomy,
        unmodeled_bytes=guard.unmodeled_bytes,
    ).peak_bytes
    # The worst step beside that KV, as the capacity counts it (a batched step only as
    # wide as the prompt's chunks).
    overhead, batch = guard.profile.capacity_terms()
    if batch is not None:
        overhead = max(overhead, batch.at(len(PROMPT), guard.chunk_tokens))
    return need + overhead + canary_bytes(Limits(2**30, 2**30, 0))


async def _outcome(engine, request_id: str):
    """The finish reason, or the error: raised at submit (the front door) or
    streamed (the forward gate, ending the request mid-prefill)."""
    try:
        outcome, _ = await generate(engine, request_id, PROMPT)
    except PrefillMemoryExceededError as exc:
        return exc
    return outcome


def _set_ceiling(pool, hard: int) -> None:
    pool.limits = Limits(hard, int(hard * 0.99), MARGIN)
    for engine in pool.loaded():
        engine.guard.publish(pool.limits)


async def _load_roomy(pool, name: str, tight: int) -> None:
    """Load ``name`` under the start-up ceiling (its own load-time profile needs
    more room than the tight one leaves), then put the tight ceiling back."""
    _set_ceiling(pool, pool.settings_ceiling)
    await pool.get_engine(name)
    _set_ceiling(pool, tight)


async def _baseline_settles(pool) -> int:
    """The baseline once the worker has observed the idle process."""
    seen = pool.baseline.num_observations
    while pool.baseline.num_observations < seen + 2:
        await asyncio.sleep(0.05)
    return pool.baseline.bytes_now()


def test_unloading_a_co_resident_model_gives_its_room_to_the_front_door(make_pool) -> None:
    pool = make_pool(memory={"prefill_transient_margin": MARGIN})
    pool.settings_ceiling = pool.limits.hard_bytes

    async def main() -> None:
        await pool.get_engine("slow-llama")
        tiny = await pool.get_engine("tiny-llama")  # loaded beside slow-llama
        both = await _baseline_settles(pool)
        await pool.unload("slow-llama")
        alone = await _baseline_settles(pool)
        slow_bytes = both - alone
        assert slow_bytes > 30 * MB, "slow-llama's weights should leave the process"
        # Room for the prompt beside tiny-llama alone, not beside both models.
        _set_ceiling(pool, alone + _room_for_prompt(tiny) + slow_bytes // 2)
        capacity_alone = tiny.guard.max_kv_tokens
        assert capacity_alone is not None and capacity_alone >= len(PROMPT)

        outcome = await _outcome(tiny, "after-unload")
        assert outcome in ("stop", "length"), outcome

        await _load_roomy(pool, "slow-llama", pool.limits.hard_bytes)
        await _baseline_settles(pool)
        outcome = await _outcome(tiny, "beside-both")
        assert isinstance(outcome, PrefillMemoryExceededError)
        assert outcome.estimated_bytes > outcome.limit_bytes == pool.limits.hard_bytes
        assert tiny.guard.max_kv_tokens < capacity_alone  # the capacity follows too

    asyncio.run(main())


def test_a_model_loaded_later_is_counted_at_the_front_door_not_the_gate(make_pool) -> None:
    pool = make_pool(memory={"prefill_transient_margin": MARGIN})
    pool.settings_ceiling = pool.limits.hard_bytes

    async def main() -> None:
        tiny = await pool.get_engine("tiny-llama")  # loaded alone
        alone = await _baseline_settles(pool)
        await pool.get_engine("slow-llama")
        slow_bytes = await _baseline_settles(pool) - alone
        await pool.unload("slow-llama")
        await _baseline_settles(pool)
        _set_ceiling(pool, alone + _room_for_prompt(tiny) + slow_bytes // 2)
        outcome = await _outcome(tiny, "alone")
        assert outcome in ("stop", "length"), outcome

        await _load_roomy(pool, "slow-llama", pool.limits.hard_bytes)
        outcome = await _outcome(tiny, "beside-later")
        # Refused up front with what to change, not let in and ended by the gate.
        assert not isinstance(outcome, MemoryPressureError), outcome
        assert isinstance(outcome, PrefillMemoryExceededError), outcome

        await pool.unload("slow-llama")
        await _baseline_settles(pool)
        outcome = await _outcome(tiny, "alone-again")
        assert outcome in ("stop", "length"), outcome

    asyncio.run(main())


def test_a_prompt_being_scored_is_work_in_flight_not_the_idle_baseline(
    make_pool, monkeypatch
) -> None:
    """Scoring (echo + logprobs) holds the prompt's KV across MLX turns while no engine
    has a request: a turn in between must not read that memory as the baseline (it
    became every later request's floor: false 400s, a smaller KV capacity)."""
    from omlx.engine.prompt_scores import prompt_logprobs
    from omlx.engine.scoring import PromptScorer
    from tests.integration.test_pool import SetProbe

    pool = make_pool(fresh_profile=True, prefill_step_size=64, memory={"max_kv_tokens": 4096})
    probe = pool.probe = SetProbe()
    probe.bytes = 100_000_000
    close = PromptScorer.close

    def freed(scorer: PromptScorer) -> None:
        close(scorer)
        probe.bytes = 100_000_000  # its arrays are gone: so is the made-up 50 MB

    monkeypatch.setattr(PromptScorer, "close", freed)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        await asyncio.sleep(0.2)  # an idle turn observes the baseline
        assert pool.live_baseline.baseline.bytes_now() == 100_000_000
        scoring = asyncio.create_task(prompt_logprobs(engine, list(range(10, 2010)), top_k=1))
        # The scorer's KV as the process reading shows it (a made-up 50 MB).
        probe.bytes = 150_000_000
        seen = []
        while not scoring.done():
            seen.append(pool.live_baseline.baseline.bytes_now())
            await asyncio.sleep(0.005)
        assert len(await scoring) == 2000
        assert len(seen) > 5 and max(seen) == 100_000_000, max(seen)

    asyncio.run(main())
