"""The MLX worker steps an engine when it is due, and sleeps until then."""

from __future__ import annotations

import time

from omlx.engine.worker import MLXWorker


class DueLater:
    """A ``Steppable`` (as ModelEngine is) whose one step falls due at ``due``:
    what an engine gathering a burst of arrivals reports."""

    def __init__(self, due: float):
        self.due = due
        self.polls = 0
        self.steps: list[float] = []

    @property
    def has_work(self) -> bool:
        return not self.steps

    @property
    def wait_s(self) -> float:
        self.polls += 1
        return max(0.0, self.due - time.monotonic())

    def step(self) -> None:
        self.steps.append(time.monotonic())


def test_an_engine_gathering_a_burst_is_stepped_when_due_and_the_worker_sleeps_meanwhile():
    worker = MLXWorker()
    worker.start()
    try:
        engine = DueLater(time.monotonic() + 0.3)
        worker.submit(worker.attach, engine).result()
        deadline = time.monotonic() + 5
        while not engine.steps and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine.steps) == 1 and engine.steps[0] >= engine.due
        # It slept on its inbox until the engine was due: a handful of checks, not
        # a busy loop (which would poll tens of thousands of times in 0.3 s).
        assert engine.polls <= 5
        worker.submit(worker.detach, engine).result()
    finally:
        worker.stop()
