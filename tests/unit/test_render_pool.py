"""The render pool stops a runaway Jinja render at its deadline and frees its thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from jinja2.exceptions import UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from omlx.api.render_pool import RenderPool
from tests.fixtures.waiting import wait_until_async

# The environment transformers renders chat templates in.
ENV = ImmutableSandboxedEnvironment()
BOMB = ENV.from_string(
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
)


async def stopped_soon(pool: RenderPool, within_s: float = 1.0) -> None:
    await wait_until_async(lambda: not pool.running(), within_s, "the render stopped")


def test_a_runaway_render_is_stopped_and_its_thread_serves_the_next_render() -> None:
    async def scenario() -> None:
        pool = RenderPool(threads=1)
        start = time.perf_counter()
        with pytest.raises(TimeoutError):
            await pool.run(BOMB.render, timeout_s=0.3)
        assert time.perf_counter() - start < 1.0
        await stopped_soon(pool)
        # The one thread is free again: a quick render does not wait behind the bomb.
        start = time.perf_counter()
        assert await pool.run(ENV.from_string("{{ 6 * 7 }}").render, timeout_s=1.0) == "42"
        assert time.perf_counter() - start < 0.5

    asyncio.run(scenario())


def test_a_cancelled_caller_stops_its_render() -> None:
    async def scenario() -> None:
        pool = RenderPool(threads=1)
        task = asyncio.ensure_future(pool.run(BOMB.render, timeout_s=60))
        await wait_until_async(lambda: pool.running() == 1, what="the bomb renders")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stopped_soon(pool)

    asyncio.run(scenario())


def test_a_job_whose_caller_gave_up_while_queued_never_runs() -> None:
    ran: list[str] = []

    async def scenario() -> None:
        pool = RenderPool(threads=1)
        slow = asyncio.ensure_future(pool.run(lambda: time.sleep(0.5)))
        await wait_until_async(lambda: pool.running() == 1, what="the slow job runs")
        with pytest.raises(TimeoutError):
            await pool.run(lambda: ran.append("queued"), timeout_s=0.1)
        await slow
        await pool.run(lambda: ran.append("later"))

    asyncio.run(scenario())
    assert ran == ["later"]


def test_errors_and_results_reach_the_caller() -> None:
    async def scenario() -> None:
        pool = RenderPool(threads=2)
        assert await pool.run(lambda: "done", timeout_s=1.0) == "done"
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 / 0, timeout_s=1.0)
        with pytest.raises(UndefinedError, match="'missing' is undefined"):
            await pool.run(ENV.from_string("{{ missing() }}").render)

    asyncio.run(scenario())


def test_many_renders_share_few_threads() -> None:
    async def scenario() -> list[str]:
        pool = RenderPool(threads=2)
        template = ENV.from_string("{{ n }}")
        jobs = [pool.run(lambda n=n: template.render(n=n), timeout_s=5.0) for n in range(50)]
        return await asyncio.gather(*jobs)

    assert asyncio.run(scenario()) == [str(n) for n in range(50)]


def test_a_render_abandoned_just_as_it_starts_is_still_stopped() -> None:
    """The caller's deadline passes in the instant a pool thread takes the job: the
    job is already running (too late to cancel) but its thread not yet known. The
    stop must still reach it; a render that escaped it would hold the GIL unbounded."""
    from concurrent.futures import Future

    from omlx.api.render_pool import _Job

    taken = threading.Event()

    class TakenSlowly(Future):
        def set_running_or_notify_cancel(self) -> bool:
            started = super().set_running_or_notify_cancel()
            taken.set()
            time.sleep(0.3)  # widens the instant between "running" and "its thread"
            return started

    def spin_for_a_while() -> None:  # Python bytecode: interruptible, bounded anyway
        end = time.monotonic() + 20
        while time.monotonic() < end:
            pass

    pool = RenderPool(threads=1)
    pool._start_threads()
    job = _Job(spin_for_a_while, TakenSlowly())
    pool._queue.put(job)
    assert taken.wait(5)
    pool._abandon(job)
    # Stopped: the pool's one thread serves the next render.
    quick = ENV.from_string("{{ 6 * 7 }}").render
    assert asyncio.run(pool.run(quick, timeout_s=3.0)) == "42"
