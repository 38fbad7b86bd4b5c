"""Two models share one process's memory (issue 40, defects 3 and 13), with real
engines on one MLX worker and a ceiling chosen by the test (MLX's own accounting:
``MLXProbe``).

A request is alone only when nothing runs in the whole process: while another
model's request holds memory, a prompt that cannot fit beside it queues (it is
not admitted as "lone" and then held until a timer ends it), and it is served
once the other request ends.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from omlx.engine.stream import RequestStream
from omlx.memory.budget import CANARY_FRACTION, Limits, held_tokens_peak_bytes
from omlx.memory.probe import PEAK_WINDOW_S
from omlx.scheduler import Request, SamplingParams
from tests.integration.test_memory_admission import MARGIN, MB, MLXProbe, generate, prompts


async def _decoding(engine, request_id: str, prompt: list[int], max_tokens: int):
    """Submit a request; returns once its first token is out, with a task for the rest."""
    stream = RequestStream(request_id, asyncio.get_running_loop())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.submit(Request(request_id, tuple(prompt), params), stream)
    first = await stream.get()
    assert first.error is None, first.error

    async def rest():
        text = first.text
        event = first
        while not event.finish_reason:
            event = await stream.get()
            if event.error is not None:
                return event.error, text
            text += event.text
        return event.finish_reason, text

    return asyncio.create_task(rest())


def _room_for_one(engine, num_tokens: int, room_bytes: int) -> int:
    """A hard limit with ``room_bytes`` beside one ``num_tokens`` prompt's peak, as
    admission prices it (a row of a batched prefill: its measured excess counts)."""
    guard = engine.guard
    peak = held_tokens_peak_bytes(
        Limits(2**40, 2**40, MARGIN),
        guard.dims,
        tokens=num_tokens,
        baseline_bytes=guard.baseline_bytes,
        chunk_tokens=guard.chunk_tokens,
        # The batched prefill as wide as this prompt's chunks, as the capacity counts it.
        overhead_bytes=guard.profile.capacity_terms()[0],
        unmodeled_bytes=guard.unmodeled_bytes
        + guard.batch_excess_bytes(min(num_tokens, guard.chunk_tokens)),
        batch=guard.profile.capacity_terms()[1],
    )
    return int((peak + room_bytes) / (1 - CANARY_FRACTION))


def test_a_prompt_that_cannot_fit_beside_another_model_s_request_queues_for_it(
    make_pool, two_models_dir: Path, mlx_probe_profiles: Path
) -> None:
    pool = make_pool(
        two_models_dir,
        max_concurrent_requests=8,
        prefill_step_size=512,
        profiles=mlx_probe_profiles,
    )

    async def main() -> None:
        probe = pool.probe = MLXProbe()
        a, b = [await pool.get_engine(name) for name in ("slow-a", "slow-b")]
        prompt_a, prompt_b = prompts(2)
        solo_a = await generate(a, "solo-a", prompt_a, max_tokens=8)
        solo_b = await generate(b, "solo-b", prompt_b, max_tokens=48)
        await asyncio.sleep(PEAK_WINDOW_S + 0.1)  # the solo runs' peaks are no longer recent
        # Room for one of these prompts at a time (its front-door peak beside the
        # live baseline, and the canary the capacity keeps), not two.
        hard = _room_for_one(a, len(prompt_a), MARGIN + 8 * MB)
        pool.limits = Limits(hard, int(hard * 0.99), MARGIN)
        for engine in (a, b):
            engine.guard.publish(pool.limits)
        probe.max_peak = 0
        rest_b = await _decoding(b, "b", prompt_b, max_tokens=48)
        result_a = await generate(a, "a", prompt_a, max_tokens=8)
        result_b = await rest_b
        # Both served, each as alone; model a's request waited in its queue for
        # model b's (a memory deferral), nothing was ended, the peak stayed bounded.
        assert (result_a, result_b) == (solo_a, solo_b)
        assert a.gate.deferrals["memory"] > 0
        assert a.num_gated == b.num_gated == 0
        probe.reading(fresh=True)
        assert probe.max_peak <= hard

    asyncio.run(main())


def test_a_busy_model_does_not_overtake_another_model_s_waiting_request(
    make_pool, two_models_dir: Path, mlx_probe_profiles: Path
) -> None:
    """First come, first served across models: while model a's request waits for
    model b's memory, b's later short request (which would fit beside b's own)
    waits behind it, so a steady stream of b's requests cannot starve a's."""
    pool = make_pool(
        two_models_dir,
        max_concurrent_requests=8,
        prefill_step_size=512,
        profiles=mlx_probe_profiles,
    )

    async def main() -> None:
        pool.probe = MLXProbe()
        a, b = [await pool.get_engine(name) for name in ("slow-a", "slow-b")]
        prompt_a, prompt_b = prompts(2)
        short = prompt_b[:40]
        solo = [
            await generate(a, "solo-a", prompt_a, max_tokens=8),
            await generate(b, "solo-short", short, max_tokens=4),
        ]
        await asyncio.sleep(PEAK_WINDOW_S + 0.1)
        hard = _room_for_one(a, len(prompt_a), MARGIN + 8 * MB)
        pool.limits = Limits(hard, int(hard * 0.99), MARGIN)
        for engine in (a, b):
            engine.guard.publish(pool.limits)
        rest_b = await _decoding(b, "b", prompt_b, max_tokens=48)
        waiting_a = asyncio.create_task(generate(a, "a", prompt_a, max_tokens=8))

        async def deferred() -> None:  # a's request is deferred for b's memory
            while a.gate.memory_wait is None:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(deferred(), timeout=120)
        rest_short = await _decoding(b, "short", short, max_tokens=4)
        # The short request's first token came only after b's long one had ended.
        assert rest_b.done()
        assert [await waiting_a, await rest_short] == solo
        assert b.gate.deferrals["memory"] > 0 and a.num_gated == b.num_gated == 0

    asyncio.run(main())
