"""A few threads that render chat templates and tokenize prompts, off the event loop.

A model's chat template is Jinja code from the model folder (or a GGUF's
metadata); it can loop as long as it is written to. Rendering it on the event
loop would freeze every route, ``/health`` included, so every render runs here,
under a deadline. Tokenizing runs here too (native code, bounded by the body
size limit) so a 32 MiB prompt does not stall other requests.

Why an asynchronous exception stops a runaway render: Jinja templates compile
to Python bytecode, so ``PyThreadState_SetAsyncExc`` interrupts the render
thread at its next bytecode and frees it for the next request. The
alternatives are worse: Jinja's sandbox has no per-iteration hook (a ``for``
over ``range`` calls nothing it intercepts), ``sys.settrace`` slows every line
and is the debugger's and coverage's hook, and a child process would need its
own copy of the tokenizer per model. Native calls (one huge string operation)
cannot be interrupted; they end on their own and the interrupt lands after.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# Enough that a slow render or a huge prompt being tokenized leaves room for
# others; few, since rendering holds the GIL. Not the default executor, which
# grammar compiles and to_thread calls share.
RENDER_THREADS = 4


class RenderInterrupted(BaseException):
    """Raised inside a render thread whose deadline passed. A BaseException, so
    the template engine's and the caller's ``except Exception`` let it through."""


@dataclass(slots=True, eq=False)
class _Job:
    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)
    # The worker running the job; None while queued and once finished.
    thread_id: int | None = None
    interrupted: bool = False


class RenderPool:
    """Daemon threads that run jobs; ``run`` awaits one with an optional deadline."""

    def __init__(self, threads: int = RENDER_THREADS, name: str = "omlx-render"):
        self._size = threads
        self._name = name
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._running: set[_Job] = set()

    async def run(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """``fn()`` on a pool thread. Past ``timeout_s`` (or when the caller is
        cancelled) the job is stopped and ``TimeoutError`` (or the cancel) is raised."""
        self._start_threads()
        job = _Job(fn)
        self._queue.put(job)
        outcome = asyncio.wrap_future(job.future)
        try:
            # shield: on timeout we decide what happens to the job (_abandon), not wait_for.
            result: T = await asyncio.wait_for(asyncio.shield(outcome), timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            self._abandon(job)
            # Nobody awaits it now; an error it ends with is not worth a warning.
            outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        return result

    def running(self) -> int:
        """Jobs running now: an abandoned render leaves this count once stopped."""
        with self._lock:
            return len(self._running)

    def _start_threads(self) -> None:
        with self._lock:
            while len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def _abandon(self, job: _Job) -> None:
        # Under the lock _run starts a job in: a job is either still queued (the
        # cancel wins) or has its thread recorded, never in between.
        with self._lock:
            if job.future.cancel():
                return  # still queued: it will never start
            if job.thread_id is None or job.interrupted:
                return  # finished meanwhile, or already stopped
            job.interrupted = True
            _raise_in_thread(job.thread_id, RenderInterrupted)

    def _work(self) -> None:
        job: _Job | None = None
        while True:
            # An interrupt is pending from _abandon until _finish clears it, and
            # may land on any line here: each turn finishes the last job first.
            try:
                if job is not None:
                    self._finish(job)
                    job = None
                job = self._queue.get()
                self._run(job)
            except RenderInterrupted:
                log.warning("stopped a render that ran past its deadline")

    def _run(self, job: _Job) -> None:
        with self._lock:
            if not job.future.set_running_or_notify_cancel():
                return
            job.thread_id = threading.get_ident()
            self._running.add(job)
        try:
            result = job.fn()
        except RenderInterrupted:
            raise
        except BaseException as exc:  # the caller gets it, whatever it is
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    def _finish(self, job: _Job) -> None:
        with self._lock:
            if job.interrupted and job.thread_id is not None:
                # The interrupt may still be pending: drop it before the next job.
                _raise_in_thread(job.thread_id, None)
            job.thread_id = None
            self._running.discard(job)


def _raise_in_thread(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Schedule ``exc_type`` in ``thread_id`` (None clears a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else None
    )
