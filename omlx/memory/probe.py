"""The only reader of MLX and OS memory. Readings are cached so the HTTP path
never queries the device per request.

MLX's counters are read on the MLX thread only (seed 003): the worker samples
them after every turn (each step, and every idle wake) and the probe keeps the
latest sample; a reading taken on another thread combines that sample with a
fresh OS footprint, which any thread may read.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import psutil

from omlx.memory import mlx_stats
from omlx.memory.budget import MemoryReading
from omlx.memory.footprint import ProcessFootprint
from omlx.memory.mlx_stats import MlxStats

log = logging.getLogger(__name__)

# How long a peak counts as "recent". Engines read every step while prefilling,
# so a second spans many steps of the work still in flight; a longer window
# would hold finished work's transients against new requests.
PEAK_WINDOW_S = 1.0


def total_ram_bytes() -> int:
    return int(psutil.virtual_memory().total)


class MemoryProbe:
    """Readings of MLX active and cached memory, the process footprint and the recent peak.

    MLX's peak counter runs from process start; the probe resets it at every
    sample and keeps the maximum of the samples within ``PEAK_WINDOW_S``, so a
    transient from a minute ago no longer counts as current.

    ``on_mlx_thread`` tells whether the caller is the MLX thread (the worker's);
    without one the caller is taken to be it (single-threaded use: scripts, tests).
    """

    def __init__(
        self,
        max_age_s: float = 1.0,
        peak_window_s: float = PEAK_WINDOW_S,
        *,
        on_mlx_thread: Callable[[], bool] | None = None,
        footprint: ProcessFootprint | None = None,
    ):
        self._max_age_s = max_age_s
        self._peak_window_s = peak_window_s
        self._on_mlx_thread = on_mlx_thread or (lambda: True)
        self._footprint = footprint or ProcessFootprint.for_this_platform()
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._last: MemoryReading | None = None
        self._mlx: MlxStats = mlx_stats.NO_STATS
        self._mlx_cache_bytes = 0
        self._peaks: deque[tuple[float, int]] = deque()
        # Highest MLX peak since ``watch_peak`` (other samples reset MLX's own
        # counter, so it is folded in here at every sample).
        self._watched_peak = 0
        # Helper processes (oQ quantization, imports) whose memory counts as ours while they run.
        self._tracked: dict[int, psutil.Process] = {}
        log.info(
            "memguard: process memory read as %s%s",
            self._footprint.source,
            "" if self._footprint.source == "phys_footprint" else " (no phys_footprint here)",
        )

    def track_process(self, pid: int) -> None:
        """Add ``pid``'s footprint to every reading until untracked."""
        with self._lock, contextlib.suppress(psutil.Error):  # already gone: nothing to add
            self._tracked[pid] = psutil.Process(pid)
            self._last = None

    def untrack_process(self, pid: int) -> None:
        with self._lock:
            self._tracked.pop(pid, None)
            self._last = None

    def publish_mlx(self) -> None:
        """MLX thread: sample MLX's counters for the readings other threads take
        (cheap allocator counters; the footprint is read when a reading is taken)."""
        with self._lock:
            self._check_mlx_thread()
            self._record_mlx(time.monotonic(), mlx_stats.sample(self))

    def reading(self, *, fresh: bool = False) -> MemoryReading:
        """The cached reading, or a new one when it is older than ``max_age_s``.
        Off the MLX thread its MLX numbers are the last published sample."""
        with self._lock:
            last = self._last
            now = time.monotonic()
            if fresh or last is None or now - last.taken_at_s > self._max_age_s:
                if self._on_mlx_thread():
                    last = self._read(now)
                else:
                    last = self._reading(now, self._footprint_bytes())
                self._last = last
            return last

    def watch_peak(self) -> MemoryReading:
        """MLX thread: start measuring a peak (the auto-profile's stress passes);
        returns the reading it starts from."""
        with self._lock:
            self._last = self._read(time.monotonic())
            self._watched_peak = 0
            return self._last

    def watched_peak(self) -> tuple[int, MemoryReading]:
        """MLX thread: (MLX's highest active bytes since ``watch_peak``, a reading taken now)."""
        with self._lock:
            self._last = self._read(time.monotonic())
            return self._watched_peak, self._last

    def _read(self, now: float) -> MemoryReading:
        """MLX thread: a full sample, published for the other threads."""
        self._check_mlx_thread()
        active, footprint, peak = self._sample()
        self._record_mlx(now, MlxStats(active, self._mlx_cache_bytes, peak))
        return self._reading(now, footprint)

    def _check_mlx_thread(self) -> None:
        if not self._on_mlx_thread():
            raise RuntimeError("MLX memory counters read off the MLX thread (seed 003)")

    def _record_mlx(self, now: float, stats: MlxStats) -> None:
        self._mlx = stats
        self._watched_peak = max(self._watched_peak, stats.peak_bytes)
        self._peaks.append((now, stats.peak_bytes))
        self._drop_old_peaks(now)

    def _sample(self) -> tuple[int, int, int]:
        """(MLX active bytes, process footprint, MLX peak since the last sample)."""
        stats = mlx_stats.sample(self)
        self._mlx_cache_bytes = stats.cache_bytes
        return stats.active_bytes, self._footprint_bytes(), stats.peak_bytes

    def _reading(self, now: float, footprint: int) -> MemoryReading:
        """The published MLX sample, the given footprint and the peaks still in the window."""
        self._drop_old_peaks(now)
        mlx = self._mlx
        return MemoryReading(
            mlx_active_bytes=mlx.active_bytes,
            process_footprint_bytes=footprint,
            recent_peak_bytes=max((p for _, p in self._peaks), default=mlx.active_bytes),
            taken_at_s=now,
            mlx_cache_bytes=mlx.cache_bytes,
        )

    def _drop_old_peaks(self, now: float) -> None:
        while self._peaks and now - self._peaks[0][0] > self._peak_window_s:
            self._peaks.popleft()

    def _footprint_bytes(self) -> int:
        total = self._footprint.bytes_of(self._process)
        for proc in self._tracked.values():
            with contextlib.suppress(psutil.Error):  # exited before untrack
                total += self._footprint.bytes_of(proc)
        return total
