"""Grammar compiles on their own small thread pool, each awaited with a time bound.

xgrammar compiles in native code that cannot be interrupted, so a compile that
runs past the bound keeps its thread until it ends. The pool's few threads keep
such runaways from piling up (and from taking asyncio's default executor): a
compile still queued when its bound passes leaves the queue unrun, and an
identical grammar asked for while one is in flight waits for that one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from omlx.errors import InvalidRequestError, QueueFullError

COMPILE_WORKERS = 2
COMPILE_TIMEOUT_S = 10.0


@dataclass
class _Job:
    future: Future[Any]
    waiters: int = field(default=0)


class CompilePool:
    """Runs blocking grammar work on ``workers`` threads named "grammar-compile"."""

    def __init__(self, workers: int = COMPILE_WORKERS, timeout_s: float = COMPILE_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._jobs: dict[Hashable, _Job] = {}
        # Reentrant: a future that is already done runs its callback at once.
        self._lock = threading.RLock()

    async def run(self, key: Hashable, work: Callable[[], Any], *, what: str, param: str) -> Any:
        """``work()``'s result (or its exception); one job per ``key`` at a time.

        InvalidRequestError (400) when it runs past ``timeout_s``, QueueFullError
        (503) when it could not even start by then (the threads are busy)."""
        job = self._join(key, work)
        timeout_s = self.timeout_s
        try:
            waiter = asyncio.shield(asyncio.wrap_future(job.future))
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            if not (job.future.running() or job.future.done()):
                raise QueueFullError(
                    f"the grammar compiler is busy with other grammars; the {what} could not "
                    f"start compiling within {timeout_s:g} s, try again shortly"
                ) from None
            raise InvalidRequestError(
                f"the {what} took longer than {timeout_s:g} s to compile; simplify it "
                "(fewer properties, alternatives or bounded repetitions)",
                param=param,
            ) from None
        finally:
            self._leave(job)

    def shutdown(self) -> None:
        """Stop taking compiles; queued ones are dropped, a running one ends on its own."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _join(self, key: Hashable, work: Callable[[], Any]) -> _Job:
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                job = _Job(self._executor.submit(work))
                self._jobs[key] = job
                job.future.add_done_callback(lambda _: self._forget(key, job))
            job.waiters += 1
            return job

    def _leave(self, job: _Job) -> None:
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0:
                # Nobody waits for it any more: drop it if it has not started.
                job.future.cancel()

    def _forget(self, key: Hashable, job: _Job) -> None:
        with self._lock:
            if self._jobs.get(key) is job:
                del self._jobs[key]
