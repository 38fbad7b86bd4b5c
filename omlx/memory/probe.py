"""The only reader of MLX and OS memory. Readings are cached so the HTTP path
never queries the device per request."""

from __future__ import annotations

import threading
import time

import psutil

from omlx.memory.budget import MemoryReading


def total_ram_bytes() -> int:
    return int(psutil.virtual_memory().total)


class MemoryProbe:
    def __init__(self, max_age_s: float = 1.0):
        self._max_age_s = max_age_s
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._last: MemoryReading | None = None

    def reading(self, *, fresh: bool = False) -> MemoryReading:
        """The cached reading, or a new one when it is older than ``max_age_s``."""
        with self._lock:
            last = self._last
            now = time.monotonic()
            if fresh or last is None or now - last.taken_at_s > self._max_age_s:
                last = self._last = self._read(now)
            return last

    def _read(self, now: float) -> MemoryReading:
        import mlx.core as mx

        return MemoryReading(
            mlx_active_bytes=int(mx.get_active_memory()),
            process_footprint_bytes=int(self._process.memory_info().rss),
            recent_peak_bytes=int(mx.get_peak_memory()),
            taken_at_s=now,
        )
