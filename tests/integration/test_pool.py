"""The engine pool with real tiny models: eviction under a weights budget, busy
models never yanked, explicit unload, pinning, TTL, aliases."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from omlx.engine.pool import EnginePool
from omlx.engine.stream import RequestStream
from omlx.engine.worker import MLXWorker
from omlx.errors import (
    InsufficientMemoryError,
    MemoryPressureError,
    ModelNotFoundError,
    ServiceUnavailableError,
)
from omlx.memory.budget import Limits
from omlx.memory.probe import MemoryProbe
from omlx.models.discovery import discover_models
from omlx.scheduler import Request, SamplingParams


def sizes(model_dir: Path) -> dict[str, int]:
    return {name: info.size_bytes for name, info in discover_models([model_dir]).items()}


_REQUEST_NUMBERS = itertools.count()


async def run(pool: EnginePool, model: str, max_tokens: int = 8) -> tuple[str, str | None]:
    """(finish reason or error code, text) of one greedy request through the pool."""
    engine = await pool.get_engine(model)
    stream = RequestStream(f"{model}-{next(_REQUEST_NUMBERS)}", asyncio.get_running_loop())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.submit(Request(stream.request_id, (5, 6, 7, 8), params), stream)
    text = ""
    while True:
        event = await stream.get()
        assert event is not None
        if event.error is not None:
            return event.error.code, text
        text += event.text
        if event.finish_reason:
            return event.finish_reason, text


def test_loading_past_the_budget_evicts_the_least_recently_used(make_pool, tiny_models_dir):
    size = sizes(tiny_models_dir)
    # slow-llama fits next to one of the small models, not next to both.
    budget = size["slow-llama"] + size["tiny-llama"] + 1024
    assert size["tiny-qwen3"] > 1024
    pool = make_pool(memory={"max_model_memory": budget})

    async def main() -> None:
        await run(pool, "tiny-llama")
        await run(pool, "tiny-qwen3")
        await run(pool, "tiny-llama")  # tiny-qwen3 is now the least recently used
        assert {e.name for e in pool.loaded()} == {"tiny-llama", "tiny-qwen3"}
        await run(pool, "slow-llama")
        assert {e.name for e in pool.loaded()} == {"tiny-llama", "slow-llama"}
        assert pool.num_evictions == 1
        states = {m["name"]: m["state"] for m in pool.status()}
        assert states == {"tiny-qwen3": "unloaded", "tiny-llama": "loaded", "slow-llama": "loaded"}

    asyncio.run(main())


def test_a_model_too_large_for_the_budget_is_refused_with_507(make_pool, tiny_models_dir):
    size = sizes(tiny_models_dir)
    pool = make_pool(memory={"max_model_memory": size["slow-llama"] - 1})

    async def main() -> None:
        with pytest.raises(InsufficientMemoryError) as err:
            await pool.get_engine("slow-llama")
        assert err.value.http_status == 507
        assert err.value.needed_bytes == size["slow-llama"]
        assert "max_model_memory" in err.value.message
        assert pool.loaded() == []  # the pool stays consistent
        assert (await run(pool, "tiny-llama"))[0] == "length"

    asyncio.run(main())


def test_a_busy_model_is_not_yanked_the_load_waits_for_it(make_pool, tiny_models_dir):
    size = sizes(tiny_models_dir)
    pool = make_pool(memory={"max_model_memory": size["slow-llama"] + size["tiny-llama"] // 2})

    async def main() -> None:
        busy = asyncio.create_task(run(pool, "slow-llama", max_tokens=120))
        while not pool.loaded() or not pool.loaded()[0].num_in_flight:
            await asyncio.sleep(0.01)
        # tiny-llama does not fit next to slow-llama: its load waits for slow-llama.
        reason, _ = await run(pool, "tiny-llama")
        assert reason == "length"
        assert busy.done() and busy.result()[0] == "length"  # finished whole, not aborted
        assert [e.name for e in pool.loaded()] == ["tiny-llama"]

    asyncio.run(main())


def test_waiting_for_busy_models_gives_up_with_507(make_pool, tiny_models_dir):
    size = sizes(tiny_models_dir)
    pool = make_pool(
        memory={"max_model_memory": size["slow-llama"] + size["tiny-llama"] // 2}, busy_wait_s=0.3
    )

    async def main() -> None:
        busy = asyncio.create_task(run(pool, "slow-llama", max_tokens=400))
        while not pool.loaded() or not pool.loaded()[0].num_in_flight:
            await asyncio.sleep(0.01)
        with pytest.raises(InsufficientMemoryError) as err:
            await pool.get_engine("tiny-llama")
        assert "busy" in err.value.message
        await pool.unload("slow-llama")
        assert (await busy)[0] == ServiceUnavailableError.code

    asyncio.run(main())


def test_a_model_leased_to_a_request_not_yet_submitted_is_not_evicted(make_pool, tiny_models_dir):
    """A route holds the engine while it renders and compiles a grammar; loading
    another model must not evict it under that request (which then could not run)."""
    size = sizes(tiny_models_dir)
    pool = make_pool(
        memory={"max_model_memory": size["tiny-llama"] + size["tiny-qwen3"] // 2}, busy_wait_s=0.3
    )

    async def main() -> None:
        async with pool.lease("tiny-llama") as engine:
            with pytest.raises(InsufficientMemoryError) as err:
                await pool.get_engine("tiny-qwen3")
            assert "busy" in err.value.message
            stream = RequestStream("leased", asyncio.get_running_loop())
            engine.submit(Request("leased", (5, 6, 7), SamplingParams(max_tokens=4)), stream)
            event = await stream.get()
            while event is not None and not event.finished:
                event = await stream.get()
            assert event is not None and event.finish_reason == "length"
        # Lease ended, nothing in flight: now it may make room.
        assert (await run(pool, "tiny-qwen3"))[0] == "length"

    asyncio.run(main())


def test_pinned_models_are_never_evicted(make_pool, tiny_models_dir):
    size = sizes(tiny_models_dir)
    pool = make_pool(
        memory={"max_model_memory": size["tiny-llama"] + size["tiny-qwen3"] // 2}, busy_wait_s=0.2
    )

    async def main() -> None:
        pool.model_settings.put("tiny-llama", {"pinned": True})
        await run(pool, "tiny-llama")
        assert pool.model_state("tiny-llama") == "pinned"
        with pytest.raises(InsufficientMemoryError) as err:
            await pool.get_engine("tiny-qwen3")
        assert "tiny-llama" in err.value.message  # says which pinned model holds the room
        pool.model_settings.put("tiny-llama", {"pinned": False})
        assert (await run(pool, "tiny-qwen3"))[0] == "length"
        assert [e.name for e in pool.loaded()] == ["tiny-qwen3"]

    asyncio.run(main())


def test_unload_with_requests_in_flight(make_pool):
    pool = make_pool()

    async def main() -> None:
        # Without a drain the request in flight fails with a clear error ...
        task = asyncio.create_task(run(pool, "slow-llama", max_tokens=400))
        while not pool.loaded() or not pool.loaded()[0].num_in_flight:
            await asyncio.sleep(0.01)
        assert await pool.unload("slow-llama") is True
        code, _ = await task
        assert code == ServiceUnavailableError.code
        # ... with one it finishes first.
        task = asyncio.create_task(run(pool, "slow-llama", max_tokens=20))
        while not pool.loaded() or not pool.loaded()[0].num_in_flight:
            await asyncio.sleep(0.01)
        assert await pool.unload("slow-llama", drain_s=30) is True
        assert (await task)[0] == "length"
        assert await pool.unload("slow-llama") is False

    asyncio.run(main())


def test_idle_models_expire_after_their_ttl(make_pool):
    now = [1000.0]
    pool = make_pool(clock=lambda: now[0])

    async def main() -> None:
        pool.model_settings.put("tiny-llama", {"ttl_s": 60})
        await run(pool, "tiny-llama")
        await run(pool, "tiny-qwen3")  # no TTL and no global idle timeout: stays
        now[0] += 59
        assert await pool.expire_idle() == []
        now[0] += 2
        assert await pool.expire_idle() == ["tiny-llama"]
        assert [e.name for e in pool.loaded()] == ["tiny-qwen3"]
        pool.settings.models.idle_timeout_s = 30
        assert await pool.expire_idle() == ["tiny-qwen3"]

    asyncio.run(main())


def test_aliases_resolve_and_unknown_names_list_them(make_pool):
    pool = make_pool()

    async def main() -> None:
        pool.model_settings.put("tiny-llama", {"alias": "llama-small"}, available=["tiny-llama"])
        engine = await pool.get_engine("llama-small")
        assert engine.name == "tiny-llama"
        assert pool.public_name("tiny-llama") == "llama-small"
        with pytest.raises(ModelNotFoundError) as err:
            await pool.get_engine("nope")
        assert "llama-small" in err.value.message

    asyncio.run(main())


# The KV capacity of the tests with made-up readings (a measured one would refuse them).
PINNED = {"max_kv_tokens": 4096}


class SetProbe(MemoryProbe):
    """The real probe with the reading set by the test (MLX's own counters are
    tiny next to a test process)."""

    def __init__(self) -> None:
        super().__init__(max_age_s=0.0)
        self.bytes = 0

    def _sample(self) -> tuple[int, int, int]:
        return self.bytes, self.bytes, self.bytes


@pytest.fixture(scope="module")
def made_up_profiles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The auto-profiles of the tests below, whose probes read a made-up number that
    does not move during a load: measured once per model and limits, and shared among
    these tests only (never with the session's real measurements)."""
    return tmp_path_factory.mktemp("made-up-profiles")


def test_enforcer_publishes_pauses_evicts_and_ends_work(make_pool, made_up_profiles):
    # The readings are made up (a few MB): a pinned KV capacity replaces the load-time
    # auto-profile's measured one, which would rightly refuse such a ceiling.
    pool = make_pool(profiles=made_up_profiles, memory=PINNED)
    probe = pool.probe = SetProbe()

    async def main() -> None:
        await run(pool, "tiny-llama")
        await run(pool, "tiny-qwen3")
        # New limits reach every loaded engine on the next poll.
        # Room under the hard limit for slow-llama's short prompt as the front door
        # prices it (its KV cache's 256-column growth step: about 4 MB).
        pool.limits = Limits(100_000_000, 80_000_000, 1_000)
        probe.bytes = 10_000_000
        await pool.enforce()
        assert all(e.guard.limits is pool.limits for e in pool.loaded())
        assert not any(e.admission_paused for e in pool.loaded())
        # Above soft: admission paused, the least recently used idle model evicted.
        probe.bytes = 90_000_000
        await pool.enforce()
        assert [e.name for e in pool.loaded()] == ["tiny-qwen3"]
        assert pool.loaded()[0].admission_paused
        # Above hard: in-flight work ends with a clear error.
        task = asyncio.create_task(run(pool, "slow-llama", max_tokens=400))
        while pool.engine("slow-llama") is None or not pool.engine("slow-llama").num_in_flight:
            assert not task.done(), task.result()
            await asyncio.sleep(0.01)
        # Loaded while paused: paused from its first step, not from the next poll.
        assert pool.engine("slow-llama").admission_paused
        probe.bytes = 110_000_000
        await pool.enforce()
        code, _ = await task
        assert code == MemoryPressureError.code
        probe.bytes = 10_000_000
        await pool.enforce()
        assert not any(e.admission_paused for e in pool.loaded())

    asyncio.run(main())


class WeightsProbe(SetProbe):
    """A reading that is ``bytes`` plus a made-up 6 MB per loaded model besides the
    busy one: what evicting an idle model gives back, as a real reading would show."""

    def __init__(self, pool: EnginePool) -> None:
        super().__init__()
        self.pool = pool

    def _sample(self) -> tuple[int, int, int]:
        idle = [e for e in self.pool.loaded() if e.name != "slow-llama"]
        used = self.bytes + 6_000_000 * len(idle)
        return used, used, used


def test_the_enforcer_reads_again_after_an_eviction_before_ending_anything(
    make_pool, made_up_profiles
):
    """Over the hard limit with the cache off, an idle model evicted gets memory under
    it: the running request goes on (the stale reading used to end it)."""
    # Made-up readings: see above.
    pool = make_pool(profiles=made_up_profiles, memory=PINNED)
    probe = pool.probe = WeightsProbe(pool)

    async def main() -> None:
        await run(pool, "tiny-llama")
        engine = await pool.get_engine("slow-llama")
        stream = RequestStream("long", asyncio.get_running_loop())
        params = SamplingParams(temperature=0.0, max_tokens=60)
        engine.submit(Request("long", (5, 6, 7, 8), params), stream)
        first = await stream.get()  # decoding: no prefill chunk left for a gate to hold
        assert first is not None and first.error is None
        pool.limits = Limits(10_000_000, 8_000_000, 1_000)
        probe.bytes = 5_000_000  # 11 MB with tiny-llama loaded, 5 MB without
        await pool.enforce()
        assert [e.name for e in pool.loaded()] == ["slow-llama"]
        assert not pool.enforcer.admission_paused  # under soft again, read afresh
        while not (event := await stream.get()).finished:
            pass
        assert event.error is None and event.finish_reason == "length"

    asyncio.run(main())


def test_a_pause_above_the_soft_limit_is_counted_and_its_deferrals_logged(
    make_pool, made_up_profiles, caplog: pytest.LogCaptureFixture
):
    # Made-up readings: see above.
    pool = make_pool(profiles=made_up_profiles, memory=PINNED)
    probe = pool.probe = SetProbe()
    caplog.set_level(logging.INFO, logger="omlx")

    async def main() -> None:
        await run(pool, "slow-llama")
        # Above the soft limit, with room under the hard one for the prompts.
        pool.limits = Limits(1_000_000_000, 100_000_000, 1_000)
        probe.bytes = 200_000_000
        await pool.enforce()
        await pool.enforce()  # still above soft: the same pause
        assert pool.enforcer.admission_paused and pool.enforcer.num_admission_pauses == 1
        engine = pool.engine("slow-llama")
        first = asyncio.create_task(run(pool, "slow-llama", max_tokens=200))
        while not engine.num_in_flight:
            assert not first.done(), first.result()
            await asyncio.sleep(0.01)
        second = asyncio.create_task(run(pool, "slow-llama", max_tokens=4))
        while not engine.gate.deferrals["paused"]:
            assert not second.done(), second.result()
            await asyncio.sleep(0.01)
        probe.bytes = 50_000_000
        await pool.enforce()
        assert not pool.enforcer.admission_paused and pool.enforcer.num_admission_pauses == 1
        assert (await second)[0] == "length" and (await first)[0] == "length"
        paused = [m for m in caplog.messages if "admission paused (memory above" in m]
        assert len(paused) == engine.gate.deferrals["paused"]
        assert all(m.startswith("memadmit slow-llama: deferred a 4-token prompt") for m in paused)
        counters = {m["name"]: m["memory_guard"] for m in pool.status()}["slow-llama"]
        assert counters["deferrals"]["paused"] == engine.gate.deferrals["paused"]

    asyncio.run(main())


def test_the_default_model_answers_to_default(make_pool):
    pool = make_pool()

    async def main() -> None:
        with pytest.raises(ModelNotFoundError):
            await pool.get_engine("default")  # none set yet
        pool.settings.models.default_model = "tiny-qwen3"
        assert (await pool.get_engine("default")).name == "tiny-qwen3"
        pool.model_settings.put("tiny-llama", {"is_default": True})  # per-model wins
        assert (await pool.get_engine("default")).name == "tiny-llama"
        assert {m["name"] for m in pool.status() if m["is_default"]} == {"tiny-llama"}

    asyncio.run(main())


def test_a_duplicate_request_id_ends_with_an_error_not_a_hang(make_pool):
    pool = make_pool()

    async def main() -> None:
        engine = await pool.get_engine("slow-llama")
        loop = asyncio.get_running_loop()
        first, second = RequestStream("same-id", loop), RequestStream("same-id", loop)
        params = SamplingParams(temperature=0.0, max_tokens=40)
        for stream in (first, second):
            engine.submit(Request("same-id", (5, 6, 7, 8), params), stream)
        event = await asyncio.wait_for(second.get(), timeout=30)
        assert event.error is not None and "duplicate request id" in event.error.message
        while not (event := await asyncio.wait_for(first.get(), timeout=30)).finish_reason:
            assert event.error is None
        assert engine.num_in_flight == 0

    asyncio.run(main())


def test_the_enforcer_hands_freed_memory_back_before_ending_anything(
    make_pool, caplog: pytest.LogCaptureFixture
):
    """Freed memory the process still holds (heap pages the C allocator keeps, as
    MLX's CPU backend leaves them) puts the footprint past the hard limit while a
    request decodes: the enforcer hands it back and the request goes on (it used to
    be ended)."""
    pool = make_pool()  # the real probe: the process footprint counts
    caplog.set_level(logging.INFO, logger="omlx")

    async def main() -> None:
        await run(pool, "slow-llama")
        engine = pool.engine("slow-llama")
        assert engine is not None
        stream = RequestStream("decoding", asyncio.get_running_loop())
        params = SamplingParams(temperature=0.0, max_tokens=60)
        engine.submit(Request("decoding", (5, 6, 7, 8), params), stream)
        first = await stream.get()  # decoding: no prefill chunk left for a gate to hold
        assert first is not None and first.error is None
        # From the reading below to the enforcer's own, nothing else may hand the freed
        # pages back (the reading is this whole process's footprint): the MLX thread is
        # parked between two steps (no memory gate's reclaim, no idle turn's after the
        # request), and no garbage of earlier tests is collected in between.
        with parked_worker(pool.worker), no_collection():
            blobs = [bytes(64 * 1024) for _ in range(4096)]  # ~256 MB of heap pages
            top = bytes(64 * 1024)  # keeps free() from trimming the heap's top
            del blobs
            held = pool.probe.reading(fresh=True).resident_bytes
            hard = held - 2**26  # above it only because of the freed pages
            pool.limits = Limits(hard, int(hard * 0.95), 1_000)
            reclaims = engine.gate.num_reclaims
            assert engine.num_in_flight == 1  # still decoding: the thread is parked
            enforcing = asyncio.create_task(pool.enforce())
            await asyncio.sleep(0)  # it has read memory and queued its hand-back
        await enforcing
        assert pool.enforcer.num_reclaims == 1 and not pool.enforcer.admission_paused
        assert engine.gate.num_reclaims == reclaims  # the enforcer handed it back
        while not (event := await stream.get()).finished:
            pass
        assert event.error is None and event.finish_reason == "length"
        assert any(
            m.startswith("memcheck: memory ") and "handed back" in m for m in caplog.messages
        )
        del top

    asyncio.run(main())


@contextlib.contextmanager
def parked_worker(worker: MLXWorker) -> Iterator[None]:
    """The MLX thread runs nothing inside the block (it waits in a task of ours);
    what is queued meanwhile runs, in order, before its next step."""
    parked, release = threading.Event(), threading.Event()

    def park() -> bool:
        parked.set()
        return release.wait(60)

    done = worker.submit(park)
    assert parked.wait(60)
    try:
        yield
    finally:
        release.set()
    assert done.result(timeout=60) is True  # released by the test, not timed out


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
