"""The memory gate covers a burst's shared opening (README "Prefix cache"): requests
starting together prefill their common opening once, in one forward before the
batch's chunks, and that forward is gated with a fresh reading like every chunk.

Real slow-llama under a ceiling set from its measured loaded size (see
test_memory_admission.py). Memory "drifts" to the limit right after the burst is
admitted (another model's load landing, say): the reading says so, while the real
MLX counters show what ran anyway.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from mlx_lm import load

from omlx.engine.pool import EnginePool
from omlx.errors import MemoryPressureError
from omlx.memory.budget import Limits
from omlx.scheduler import Scheduler
from tests.fixtures.budget_view import BudgetView
from tests.integration.test_memory_admission import MARGIN, MB, MLXProbe, generate
from tests.integration.test_runner_steps import make_runner, reference, request, run, tokens_of

BURST = 3
OPENING = [(11 * i) % 380 + 4 for i in range(300)]  # a long system prompt
PROMPTS = [OPENING + [(7 * i + 13 * k) % 300 + 3 for i in range(20)] for k in range(BURST)]


class DriftProbe(MLXProbe):
    """Real MLX readings, except the next ``spikes`` readings once the whole burst
    is admitted (after ``skip`` real ones), which show memory at ``at_limit``.
    Records how much real MLX memory grew during those readings (peak since the
    reading before)."""

    def __init__(self) -> None:
        super().__init__()
        self.engine = None
        self.at_limit = 0
        self.spikes = 0
        self.skip = 0
        # False: memory is at the limit whatever runs (not only the whole burst).
        self.whole_burst_only = True
        self.grown_at_limit = 0
        self._last_active = 0

    def _sample(self) -> tuple[int, int, int]:
        active, _, peak = super()._sample()
        before, self._last_active = self._last_active, active
        engine = self.engine
        if engine is None or self.spikes == 0:
            return active, active, peak
        whole = engine.num_in_flight - engine.num_queued == BURST
        if self.whole_burst_only and not whole:  # not admitted yet, or some preempted
            return active, active, peak
        if self.skip:
            self.skip -= 1
            return active, active, peak
        self.spikes -= 1
        self.grown_at_limit = max(self.grown_at_limit, peak - before)
        return self.at_limit, self.at_limit, peak


async def burst(pool: EnginePool, engine) -> list:
    """Submit the burst while the MLX thread is held, so one step admits it whole."""
    hold = threading.Event()
    pool.worker.post(hold.wait)
    tasks = [asyncio.create_task(generate(engine, f"b-{k}", p)) for k, p in enumerate(PROMPTS)]
    await asyncio.sleep(0.05)  # every submit is queued behind the hold
    hold.set()
    return await asyncio.gather(*tasks)


async def setup(pool: EnginePool):
    """slow-llama with ample room under its ceiling (the burst is admitted whole and
    shares its opening), each prompt's output alone, and the probe armed."""
    probe = pool.probe = DriftProbe()
    engine = await pool.get_engine("slow-llama")
    baseline = probe.reading(fresh=True).resident_bytes
    hard = baseline + MARGIN + 400 * MB
    pool.limits = Limits(hard, int(hard * 0.99), MARGIN)
    engine.guard.publish(pool.limits)
    solo = [await generate(engine, f"solo-{k}", p) for k, p in enumerate(PROMPTS)]
    probe.engine, probe.at_limit = engine, hard - MARGIN // 2
    return engine, probe, solo


def test_a_shared_opening_held_back_by_the_gate_is_prefilled_per_request(make_pool) -> None:
    """Memory is at the limit for the shared opening's reading: the shared
    forward is not run (today it runs without a reading, and the chunks' gate then
    ends every request); each request prefills the opening in its own gated chunks
    and all are served with the output they get alone."""
    pool = make_pool(fresh_profile=True, max_concurrent_requests=8, prefill_step_size=512)

    async def main() -> None:
        engine, probe, solo = await setup(pool)
        # The step's chunk gate reads first (real memory: the chunks fit); the shared
        # opening's gate reads next, as the scheduler plans the opening.
        probe.skip, probe.spikes = 1, 1
        together = await burst(pool, engine)
        assert probe.spikes == 0  # the drifted reading was taken
        assert together == solo
        assert engine.gate.num_unshared_openings == 1 and engine.num_gated == 0

    asyncio.run(main())


def test_no_shared_forward_runs_while_memory_is_at_the_limit(make_pool) -> None:
    """Memory is at the limit while the whole burst runs: no forward ran after the
    reading said so (the shared opening's forward would grow MLX by its KV and
    activations); the gate sends the newest requests back to the queue instead of
    ending them, and every request completes with the output it gets alone."""
    pool = make_pool(fresh_profile=True, max_concurrent_requests=8, prefill_step_size=512)

    async def main() -> None:
        engine, probe, solo = await setup(pool)
        probe.spikes = 1000
        results = await burst(pool, engine)
        assert results == solo
        assert engine.guard_counters()["deferrals"]["memory"] >= 1 and engine.num_gated == 0
        assert engine.num_in_flight == 0
        assert probe.grown_at_limit < 1 * MB

    asyncio.run(main())


def test_memory_at_the_limit_whatever_runs_ends_the_burst_with_503(make_pool) -> None:
    """Memory stays at the limit however few requests run: preempting cannot help
    a lone request, so each ends with the gate's retryable 503, and no forward ran
    at the limit."""
    pool = make_pool(fresh_profile=True, max_concurrent_requests=8, prefill_step_size=512)

    async def main() -> None:
        engine, probe, _ = await setup(pool)
        probe.spikes, probe.whole_burst_only = 10**9, False
        results = await burst(pool, engine)
        for error, text in results:
            assert isinstance(error, MemoryPressureError) and error.http_status == 503
            assert text == ""
        assert engine.num_gated == BURST and engine.num_in_flight == 0
        assert probe.grown_at_limit < 1 * MB

    asyncio.run(main())


def test_the_plan_asks_before_each_shared_forward_and_falls_back_when_refused(
    tiny_models_dir: Path,
) -> None:
    """The scheduler asks the gate with the shared forward's size (one row, the
    opening's tokens after what is cached); refused, the plan has no opening and
    every request keeps its whole prompt to prefill in its own chunks and still
    gets mlx-lm's tokens for it."""
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    opening = [(11 * i) % 180 + 4 for i in range(24)]
    prompts = {
        "a": opening + [(7 * i) % 150 + 3 for i in range(9)],
        "b": opening + [(5 * i) % 140 + 2 for i in range(17)],
    }
    asked: list[tuple[int, int]] = []

    def refuse(num_tokens: int, num_cached: int, num_running: int) -> bool:
        asked.append((num_tokens, num_cached))
        return False

    runner = make_runner(model, 64)
    scheduler = Scheduler(4, 8, prefill_step_size=64, share_openings=runner.shares_openings)
    for rid, p in prompts.items():
        scheduler.add(request(rid, p, 6))
    view = BudgetView(budget=10**6)
    view.may_share = refuse  # type: ignore[method-assign]
    plan = scheduler.schedule(view)
    assert asked == [(24, 0)] and plan.openings == ()
    runner.add(plan.admitted, plan.openings)
    left = {c.request_id: c.num_remaining for c in runner.prefill_plan()}
    assert left == {rid: len(p) for rid, p in prompts.items()}
    got = tokens_of(run(runner, 10))
    for rid, prompt in prompts.items():
        assert got[rid][:6] == reference(model, prompt, 6), rid
    runner.close()
