"""What one model's gate learns from the MLX worker about the rest of the process
(issue 40, defect 3): the requests other models run, and whether any of that work
goes on. A model whose prefill all waits for memory with nothing decoding
(``stalled``) frees nothing, so no other model waits for it: two models never
wait for each other."""

from __future__ import annotations

from dataclasses import dataclass

from omlx.engine.worker import MLXWorker


@dataclass
class _Engine:
    """A Steppable (worker.py's protocol) with a given load; never stepped here."""

    num_running: int = 0
    stalled: bool = False
    waiting_for_memory_since: float | None = None
    wait_s: float = 0.0

    @property
    def has_work(self) -> bool:
        return self.num_running > 0

    def step(self) -> None:
        raise AssertionError("not stepped in this test")


def _worker(*engines: _Engine) -> MLXWorker:
    worker = MLXWorker()  # not started: these questions only read its engines
    for engine in engines:
        worker.attach(engine)
    return worker


def test_the_process_s_running_work_besides_one_model() -> None:
    a, b, c = _Engine(num_running=2), _Engine(num_running=3), _Engine()
    worker = _worker(a, b, c)
    assert worker.running_besides(a) == 3 and worker.running_besides(b) == 2
    assert worker.running_besides(c) == 5
    worker.hold(True)  # a prompt being scored holds memory across turns
    assert worker.running_besides(a) == 4


def test_work_that_waits_for_memory_itself_is_not_waited_for() -> None:
    a, b = _Engine(num_running=1), _Engine(num_running=1)
    worker = _worker(a, b)
    assert worker.progressing_besides(a) and worker.progressing_besides(b)
    b.stalled = True
    assert not worker.progressing_besides(a)
    assert worker.progressing_besides(b)
    b.num_running = 0
    assert not worker.progressing_besides(a)
    worker.hold(True)
    assert worker.progressing_besides(a)


def test_the_earliest_request_another_model_defers_for_memory() -> None:
    """Admission is first come, first served across models: a model admits nothing
    that arrived after another model's deferred head (a busy model cannot starve
    another)."""
    a, b, c = _Engine(), _Engine(waiting_for_memory_since=7.5), _Engine()
    worker = _worker(a, b, c)
    assert worker.waiting_besides(a) == 7.5 and worker.waiting_besides(b) is None
    c.waiting_for_memory_since = 0.0
    assert worker.waiting_besides(a) == 0.0 and worker.waiting_besides(b) == 0.0
