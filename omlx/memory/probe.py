"""The only reader of MLX and OS memory. Readings are cached so the HTTP path
never queries the device per request."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

import psutil

from omlx.memory.budget import MemoryReading

# How long a peak counts as "recent". Engines read every step while prefilling,
# so a second spans many steps of the work still in flight; a longer window
# would hold finished work's transients against new requests.
PEAK_WINDOW_S = 1.0


def total_ram_bytes() -> int:
    return int(psutil.virtual_memory().total)


class MemoryProbe:
    """Readings of MLX active memory, the process footprint and the recent peak.

    MLX's peak counter runs from process start; the probe resets it at every
    reading and keeps the maximum of the readings within ``PEAK_WINDOW_S``, so a
    transient from a minute ago no longer counts as current.
    """

    def __init__(self, max_age_s: float = 1.0, peak_window_s: float = PEAK_WINDOW_S):
        self._max_age_s = max_age_s
        self._peak_window_s = peak_window_s
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._last: MemoryReading | None = None
        self._peaks: deque[tuple[float, int]] = deque()
        # Highest MLX peak since ``watch_peak`` (other threads' readings reset
        # MLX's own counter, so it is folded in here at every sample).
        self._watched_peak = 0
        # Helper processes (oQ quantization) whose RSS counts as ours while they run.
        self._tracked: dict[int, psutil.Process] = {}

    def track_process(self, pid: int) -> None:
        """Add ``pid``'s resident memory to the footprint of every reading until untracked."""
        with self._lock, contextlib.suppress(psutil.Error):  # already gone: nothing to add
            self._tracked[pid] = psutil.Process(pid)
            self._last = None

    def untrack_process(self, pid: int) -> None:
        with self._lock:
            self._tracked.pop(pid, None)
            self._last = None

    def reading(self, *, fresh: bool = False) -> MemoryReading:
        """The cached reading, or a new one when it is older than ``max_age_s``."""
        with self._lock:
            last = self._last
            now = time.monotonic()
            if fresh or last is None or now - last.taken_at_s > self._max_age_s:
                last = self._last = self._read(now)
            return last

    def watch_peak(self) -> MemoryReading:
        """Start measuring a peak (the auto-profile's stress passes); returns the
        reading it starts from."""
        with self._lock:
            self._last = self._read(time.monotonic())
            self._watched_peak = 0
            return self._last

    def watched_peak(self) -> tuple[int, MemoryReading]:
        """(MLX's highest active bytes since ``watch_peak``, a reading taken now)."""
        with self._lock:
            self._last = self._read(time.monotonic())
            return self._watched_peak, self._last

    def _read(self, now: float) -> MemoryReading:
        active, footprint, peak = self._sample()
        self._watched_peak = max(self._watched_peak, peak)
        self._peaks.append((now, peak))
        while self._peaks and now - self._peaks[0][0] > self._peak_window_s:
            self._peaks.popleft()
        return MemoryReading(
            mlx_active_bytes=active,
            process_footprint_bytes=footprint,
            recent_peak_bytes=max(p for _, p in self._peaks),
            taken_at_s=now,
        )

    def _sample(self) -> tuple[int, int, int]:
        """(MLX active bytes, process footprint, MLX peak since the last sample)."""
        import mlx.core as mx

        peak = int(mx.get_peak_memory())
        mx.reset_peak_memory()
        footprint = int(self._process.memory_info().rss) + self._tracked_bytes()
        return int(mx.get_active_memory()), footprint, peak

    def _tracked_bytes(self) -> int:
        total = 0
        for proc in self._tracked.values():
            with contextlib.suppress(psutil.Error):  # exited before untrack
                total += int(proc.memory_info().rss)
        return total
