"""Keeping the pool's idle baseline live from the MLX thread (memory/baseline.py
says what the number is for): observed after every turn with nothing in flight,
moved by what each load, unload or draft swap measured while work runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from omlx.engine.worker import MLXWorker
from omlx.memory import mlx_stats
from omlx.memory.baseline import IdleBaseline
from omlx.memory.probe import MemoryProbe


class LiveBaseline:
    """``probe`` returns the pool's probe in force (the pool's attribute may be
    swapped after this is made)."""

    def __init__(self, probe: Callable[[], MemoryProbe], worker: MLXWorker) -> None:
        self.baseline = IdleBaseline()
        self._probe_of = probe
        self._worker = worker
        self._went_busy = False
        worker.after_every_turn(self._after_turn)

    def bytes_now(self) -> int:
        """The baseline, never above what is in use right now."""
        return self.baseline.bytes_now(self._probe_of().reading())

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """MLX thread, around a load, unload or draft swap: observe the baseline
        after it, or (work in flight) move it by what the change measured."""
        before = self._probe_of().reading(fresh=True)
        yield
        after = self._probe_of().reading(fresh=True)
        if self._worker.has_work():
            self.baseline.moved(after.in_use_bytes - before.in_use_bytes)
        else:
            self.baseline.observe_idle(after)

    def _after_turn(self) -> None:
        """MLX thread, after every turn: publish MLX's counters. With nothing in
        flight the reading is also the live baseline; when the last request has
        just ended, the memory it freed goes back to the machine first."""
        if self._worker.has_work():
            self._went_busy = True
            self._probe_of().publish_mlx()
            return
        if self._went_busy:
            self._went_busy = False
            mlx_stats.release_cache()
        self.baseline.observe_idle(self._probe_of().reading(fresh=True))
