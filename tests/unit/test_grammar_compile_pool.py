"""The grammar compile pool: a time bound per compile, and runaways that cannot pile up.

A "runaway" here is work that blocks until the test releases it, as a native
compile that cannot be interrupted does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from omlx.errors import InvalidRequestError, QueueFullError
from omlx.grammar.compile_pool import CompilePool


@pytest.fixture
def release() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # let every runaway end with the test


def runaway(release: threading.Event, ran: list[str], name: str):
    def work() -> str:
        ran.append(name)
        release.wait(30)
        return name

    return work


async def run(pool: CompilePool, key: str, work) -> object:
    return await pool.run(key, work, what="JSON schema", param="response_format")


def test_a_compile_past_the_bound_is_a_400_naming_it_and_does_not_wait(
    release: threading.Event,
) -> None:
    pool = CompilePool(workers=2, timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(run(pool, "slow", runaway(release, [], "slow")))
    assert time.monotonic() - start < 5
    assert info.value.http_status == 400 and info.value.param == "response_format"
    assert "the JSON schema took longer than 0.2 s to compile; simplify it" in info.value.message


def test_runaways_hold_at_most_the_pool_and_queued_work_leaves_unrun(
    release: threading.Event,
) -> None:
    pool = CompilePool(workers=2, timeout_s=0.2)
    ran: list[str] = []

    async def scenario() -> list[object]:
        return await asyncio.gather(
            run(pool, "a", runaway(release, ran, "a")),
            run(pool, "b", runaway(release, ran, "b")),
            run(pool, "c", runaway(release, ran, "c")),
            return_exceptions=True,
        )

    first, second, queued = asyncio.run(scenario())
    assert isinstance(first, InvalidRequestError) and isinstance(second, InvalidRequestError)
    assert isinstance(queued, QueueFullError) and queued.http_status == 503
    assert "busy with other grammars" in queued.message
    release.set()
    time.sleep(0.3)
    assert sorted(ran) == ["a", "b"]  # "c" was dropped from the queue, never run


def test_one_runaway_leaves_the_other_thread_to_other_compiles(release: threading.Event) -> None:
    pool = CompilePool(workers=2, timeout_s=1.0)

    async def scenario() -> list[object]:
        return await asyncio.gather(
            run(pool, "slow", runaway(release, [], "slow")),
            run(pool, "quick", lambda: "compiled"),
            return_exceptions=True,
        )

    slow, quick = asyncio.run(scenario())
    assert isinstance(slow, InvalidRequestError) and quick == "compiled"


def test_identical_compiles_in_flight_run_once(release: threading.Event) -> None:
    pool = CompilePool(workers=2, timeout_s=5.0)
    ran: list[str] = []

    async def scenario() -> list[object]:
        waiting = [asyncio.ensure_future(run(pool, "same", runaway(release, ran, "same")))]
        await asyncio.sleep(0.05)
        waiting.append(asyncio.ensure_future(run(pool, "same", runaway(release, ran, "same"))))
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(*waiting)

    assert asyncio.run(scenario()) == ["same", "same"]
    assert ran == ["same"]


def test_a_timed_out_runaway_is_joined_not_started_again(release: threading.Event) -> None:
    pool = CompilePool(workers=2, timeout_s=0.2)
    ran: list[str] = []
    for _ in range(3):
        with pytest.raises(InvalidRequestError, match="took longer"):
            asyncio.run(run(pool, "bomb", runaway(release, ran, "bomb")))
    assert ran == ["bomb"]  # one thread spent on it, however often it is asked for
    # The other thread still compiles.
    assert asyncio.run(run(pool, "fine", lambda: "ok")) == "ok"


def test_the_work_s_own_error_reaches_the_caller() -> None:
    pool = CompilePool(workers=1, timeout_s=5.0)

    def invalid() -> None:
        raise InvalidRequestError("invalid regex: bad", param="structured_outputs.regex")

    with pytest.raises(InvalidRequestError, match="invalid regex: bad"):
        asyncio.run(run(pool, "bad", invalid))
