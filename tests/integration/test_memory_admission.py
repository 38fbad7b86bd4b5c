"""Memory admission and the forward gate with a real model and a ceiling chosen
by the test.

The process footprint of a test process (Python, MLX, pytest) is large and
noisy next to a tiny model, so these tests read MLX's own accounting only
(``MLXProbe``: the real probe without the RSS term). The ceiling is set a few
prompts above the loaded model; every byte the estimate and the gate see is
real MLX memory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from omlx.engine.pool import EnginePool
from omlx.engine.stream import RequestStream
from omlx.errors import MemoryPressureError
from omlx.memory.budget import Limits
from omlx.memory.probe import PEAK_WINDOW_S, MemoryProbe
from omlx.scheduler import Request, SamplingParams

MB = 1_000_000
PROMPT = 1024  # tokens: ~17 MB of KV on slow-llama
MARGIN = 64 * MB


class MLXProbe(MemoryProbe):
    """Real MLX readings without the process footprint; remembers the highest peak
    (of the real readings). With ``drifted_to`` set, the readings say that much is
    held; with ``drift_bytes``, that much more than MLX holds (something else grew)."""

    def __init__(self) -> None:
        super().__init__(max_age_s=0.0)
        self.max_peak = 0
        self.drifted_to: int | None = None
        self.drift_bytes = 0

    def _sample(self) -> tuple[int, int, int]:
        active, _, peak = super()._sample()
        self.max_peak = max(self.max_peak, peak, active)
        if self.drifted_to is not None:
            return self.drifted_to, self.drifted_to, peak
        held = active + self.drift_bytes
        return held, held, max(peak, held)


async def generate(engine, request_id: str, prompt: list[int], max_tokens: int = 4):
    stream = RequestStream(request_id, asyncio.get_running_loop())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.submit(Request(request_id, tuple(prompt), params), stream)
    text = ""
    while True:
        event = await stream.get()
        if event.error is not None:
            return event.error, text
        text += event.text
        if event.finish_reason:
            return event.finish_reason, text


async def load_with_ceiling(pool: EnginePool, room_bytes: int):
    """slow-llama under a hard limit ``room_bytes`` + margin above its loaded size."""
    probe = pool.probe = MLXProbe()
    engine = await pool.get_engine("slow-llama")
    baseline = probe.reading(fresh=True).resident_bytes
    hard = baseline + MARGIN + room_bytes
    pool.limits = Limits(hard, int(hard * 0.99), MARGIN)
    engine.guard.publish(pool.limits)
    return engine, probe, hard


def prompts(n: int) -> list[list[int]]:
    return [[5 + (i * 7 + j) % 400 for j in range(PROMPT)] for i in range(n)]


def test_concurrent_prompts_that_cannot_all_fit_queue_and_all_complete(
    make_pool, mlx_probe_profiles: Path
) -> None:
    pool = make_pool(profiles=mlx_probe_profiles, max_concurrent_requests=8, prefill_step_size=512)

    async def main() -> None:
        # Room for two of these prompts at once, not three.
        engine, probe, hard = await load_with_ceiling(pool, room_bytes=90 * MB)
        solo = [await generate(engine, f"solo-{i}", p) for i, p in enumerate(prompts(3))]
        await asyncio.sleep(PEAK_WINDOW_S + 0.1)  # the solo runs' peaks are no longer recent
        probe.max_peak = 0
        together = await asyncio.gather(
            *(generate(engine, f"c-{i}", p) for i, p in enumerate(prompts(3)))
        )
        assert together == solo  # all complete, same greedy output as alone
        assert engine.num_deferrals > 0  # later ones waited in the queue
        assert engine.num_gated == 0  # admitted work never trips the gate
        probe.reading(fresh=True)
        assert probe.max_peak <= hard

    asyncio.run(main())


def test_an_ample_ceiling_defers_nothing(make_pool, mlx_probe_profiles: Path) -> None:
    pool = make_pool(profiles=mlx_probe_profiles, max_concurrent_requests=8, prefill_step_size=512)

    async def main() -> None:
        engine, _, _ = await load_with_ceiling(pool, room_bytes=4000 * MB)
        results = await asyncio.gather(
            *(generate(engine, f"a-{i}", p) for i, p in enumerate(prompts(3)))
        )
        assert all(r[0] == "length" for r in results)
        assert engine.num_deferrals == 0

    asyncio.run(main())


def test_the_gate_ends_a_prefill_when_memory_drifted(make_pool, mlx_probe_profiles: Path) -> None:
    pool = make_pool(profiles=mlx_probe_profiles, max_concurrent_requests=8, prefill_step_size=128)

    async def main() -> None:
        engine, probe, hard = await load_with_ceiling(pool, room_bytes=120 * MB)
        # Something else grew after admission: the next reading is at the limit.
        probe.drifted_to = hard - MARGIN // 2
        error, text = await generate(engine, "drift", prompts(1)[0])
        assert isinstance(error, MemoryPressureError)
        assert error.http_status == 503 and "retry" in error.message
        assert text == "" and engine.num_gated == 1
        assert engine.num_in_flight == 0
        probe.drifted_to = None
        assert (await generate(engine, "after", prompts(1)[0]))[0] == "length"

    asyncio.run(main())
