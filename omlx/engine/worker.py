"""The one thread that owns all MLX work for all loaded models.

MLX streams are per thread, and arrays crossing threads have crashed other
servers, so model loads, forward steps and sampling all run here. Other
threads talk to it through an inbox of callables.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from omlx.memory import mlx_stats

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


class Steppable(Protocol):
    @property
    def has_work(self) -> bool: ...
    @property
    def wait_s(self) -> float:
        """Seconds before a step would do anything (0: now)."""
        ...

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished (queued ones hold no memory)."""
        ...

    @property
    def stalled(self) -> bool:
        """Whether its last step ran nothing: every request's prefill waited for memory
        and none was decoding (it frees nothing until someone else does)."""
        ...

    @property
    def waiting_for_memory_since(self) -> float | None:
        """The arrival time of its queue's head while memory admission defers it."""
        ...

    def step(self) -> None: ...


class MLXWorker:
    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._engines: list[Steppable] = []
        # Run on this thread after every turn (steps, idle wakes) and submitted task.
        self._after_turn: list[Callable[[], None]] = []
        # Tasks that hold memory across turns outside any engine (a prompt being
        # scored chunk by chunk): work in flight for the idle baseline.
        self._num_holding = 0
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-worker", daemon=True)
        self.stream: Any = None  # the MLX stream of this thread, made on it

    def start(self) -> None:
        self._thread.start()
        self.submit(lambda: None).result()  # wait until the thread has its stream

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.is_alive:
            return
        self._stopping.set()
        self._inbox.put(None)
        self._done.wait(timeout_s)

    def on_thread(self) -> bool:
        """True when called on the MLX thread itself."""
        return threading.current_thread() is self._thread

    def after_every_turn(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the MLX thread after each turn and each submitted task, e.g.
        to publish MLX's memory counters, which only this thread may read."""
        self._after_turn.append(fn)

    def has_work(self) -> bool:
        """MLX thread: whether any engine has requests in flight, or a task holds
        memory between turns (``hold``)."""
        return self._num_holding > 0 or any(e.has_work for e in self._engines)

    def hold(self, holding: bool) -> None:
        """MLX thread: a task starts (True) or stops (False) holding memory across
        turns, so no turn in between reads its memory as the idle baseline."""
        self._num_holding += 1 if holding else -1

    def running_besides(self, engine: Steppable | None) -> int:
        """MLX thread: the requests engines other than ``engine`` run, and the tasks
        holding memory: the process's work in flight that is not this model's."""
        others = sum(e.num_running for e in self._engines if e is not engine)
        return others + self._num_holding

    def waiting_besides(self, engine: Steppable | None) -> float | None:
        """MLX thread: the earliest arrival among other engines' queue heads that
        memory admission defers (None: none waits): admission is first come, first
        served across models, so a busy model cannot starve another one."""
        waits = (e.waiting_for_memory_since for e in self._engines if e is not engine)
        return min((t for t in waits if t is not None), default=None)

    def progressing_besides(self, engine: Steppable | None) -> bool:
        """MLX thread: whether work in flight besides ``engine``'s goes on, and so will
        end and free memory: a holding task, or an engine with running requests whose
        last step was not stalled waiting for memory itself."""
        if self._num_holding > 0:
            return True
        return any(e.num_running > 0 and not e.stalled for e in self._engines if e is not engine)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._done.is_set()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the MLX thread; the future holds its result or error."""
        future: Future[Any] = Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args)
            except BaseException as exc:
                self._run_after_turn()
                future.set_exception(exc)
            else:
                # Published before the caller wakes: it reads memory as the task left it.
                self._run_after_turn()
                future.set_result(result)

        self._inbox.put(call)
        return future

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget; errors are logged."""
        self._inbox.put(lambda: fn(*args))

    def attach(self, engine: Steppable) -> None:
        """MLX thread: start stepping an engine."""
        self._engines.append(engine)

    def detach(self, engine: Steppable) -> None:
        """MLX thread: stop stepping an engine."""
        self._engines.remove(engine)

    def _run(self) -> None:
        import mlx.core as mx

        self.stream = mx.new_stream(mx.default_device())
        with mx.stream(self.stream):
            while not self._stopping.is_set():
                self._turn()
        # Decode steps leave the next token computing asynchronously (unless it waits
        # on a lost distributed rank: then it never finishes, mlx_stats.streams_stuck).
        if mlx_stats.may_synchronize():
            mx.synchronize(self.stream)
        self._done.set()
        # Park instead of exiting: MLX's thread-local compile cache is destroyed
        # in the thread's exit handlers and needs the GIL; if that races with
        # interpreter shutdown the process aborts. A parked daemon thread just
        # ends with the process.
        threading.Event().wait()

    def _turn(self) -> None:
        """Drain the inbox, then one step for every busy engine (round robin).
        A method, so no engine stays referenced from this thread's frame while
        it waits (an unloaded model's memory must be freed at once)."""
        busy = [e for e in self._engines if e.has_work]
        waits = [e.wait_s for e in busy]
        ready = [e for e, wait in zip(busy, waits, strict=True) if wait <= 0]
        # Nothing to step yet (idle, or gathering a burst): sleep on the inbox until
        # the first engine is due, or a new task (an arrival) comes in.
        self._drain(timeout=None if ready else min(waits, default=_IDLE_WAIT_S))
        for engine in ready:
            if engine in self._engines:
                self._step(engine)
        self._run_after_turn()

    def _run_after_turn(self) -> None:
        for fn in self._after_turn:
            try:
                fn()
            except Exception:
                log.exception("MLX worker after-turn task failed")

    def _drain(self, *, timeout: float | None) -> None:
        """Run every queued task; with ``timeout``, first wait that long for one."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                try:
                    item()
                except Exception:
                    log.exception("MLX worker task failed")
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _step(engine: Steppable) -> None:
        try:
            engine.step()
        except Exception:
            log.exception("engine step crashed")
