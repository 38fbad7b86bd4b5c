"""MLX's own memory counters and limits: the only module that calls them.

Every call here belongs on the MLX worker thread (seed 003: no MLX call on the
HTTP path); the probe samples on that thread and publishes the numbers. The one
exception is ``device_cap``: a device query, read once as the pool is built.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omlx.memory.budget import DeviceCap, Limits
from omlx.memory.footprint import trim_heap, wired_limit_bytes
from omlx.sizes import format_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MlxStats:
    """One sample of MLX's allocator; published as a unit (a reference swap)."""

    active_bytes: int
    cache_bytes: int
    # Highest active bytes since the previous sample (the counter is reset at each).
    peak_bytes: int


NO_STATS = MlxStats(0, 0, 0)

# MLX's peak counter is one per process and every sample restarts it, so each
# reader keeps its own running peak here: another reader's sample (another MLX
# thread's probe) must never hide the peak of a pass this one is measuring.
_peaks_lock = threading.Lock()
_peak_since_sample: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()


def sample(reader: object) -> MlxStats:
    """MLX thread: read the counters; the peak is the highest active bytes since
    ``reader``'s previous sample, whoever restarted MLX's counter in between."""
    import mlx.core as mx

    with _peaks_lock:
        peak = int(mx.get_peak_memory())
        mx.reset_peak_memory()
        for other in list(_peak_since_sample):
            _peak_since_sample[other] = max(_peak_since_sample[other], peak)
        mine = max(_peak_since_sample.get(reader, 0), peak)
        _peak_since_sample[reader] = 0
    return MlxStats(int(mx.get_active_memory()), int(mx.get_cache_memory()), mine)


# Why MLX's streams may hold work that never finishes (None: they hold none): a
# collective whose peer rank died (distributed/control.py). MLX's clear_cache and
# synchronize wait for the streams, holding the GIL, so one such wait would stop the
# whole server (its event loop too) from answering; they are skipped from then on.
_streams_stuck: str | None = None


def streams_stuck(why: str) -> None:
    """Any thread: MLX's streams may never finish what they hold (``why``); the memory
    it holds stays taken, and nothing waits for the streams from now on."""
    global _streams_stuck
    if _streams_stuck is None:
        log.warning("memguard: MLX's cache is no longer handed back: %s", why)
    _streams_stuck = why


def may_synchronize() -> bool:
    """Whether waiting for MLX's streams ends (``streams_stuck`` was not called)."""
    return _streams_stuck is None


def release_cache() -> None:
    """MLX thread: hand MLX's cache of freed buffers (and the heap pages they
    leave on the CPU backend) back to the system, so readings count only what
    is in use and the rest of the machine gets the memory."""
    import mlx.core as mx

    if _streams_stuck is not None:
        return  # clear_cache synchronizes first
    mx.clear_cache()
    trim_heap()


def device_cap(
    device_info: Callable[[], Mapping[str, Any]] | None = None,
    wired_limit: Callable[[], int | None] = wired_limit_bytes,
) -> DeviceCap:
    """Metal's recommended working set (from MLX's device info) and the macOS wired
    limit, read at start (a query: no allocation, no request yet); neither exists on
    the CPU backend. ``device_info`` and ``wired_limit`` stand in for MLX and the OS in
    tests."""
    if device_info is None:
        import mlx.core as mx

        if not mx.metal.is_available():
            return DeviceCap()
        device_info = mx.device_info
    working_set = device_info().get("max_recommended_working_set_size")
    working_set = int(working_set) if isinstance(working_set, int) and working_set > 0 else None
    return DeviceCap(working_set, wired_limit())


def mlx_limits(limits: Limits) -> tuple[int, int]:
    """(MLX memory limit, MLX cache limit) from the server's limits.

    MLX alone may use up to the hard limit; its cache of freed buffers is capped
    at the band between the soft and hard limits, so idle cached buffers cannot
    hold the process above the soft limit by more than that band (admission
    pauses above soft, and MLX reclaims the cache past its limit on allocation).
    """
    return limits.hard_bytes, max(0, limits.hard_bytes - limits.soft_bytes)


def apply_limits(limits: Limits) -> None:
    """MLX thread: set MLX's own limits on Metal (a second line under the guard)."""
    import mlx.core as mx

    if not mx.metal.is_available():
        log.info(
            "memguard: MLX runs on the CPU backend, where its memory and cache limits "
            "do not cap allocations; left unset (the guard's readings are the only line)"
        )
        return
    memory, cache = mlx_limits(limits)
    mx.set_memory_limit(memory)
    mx.set_cache_limit(cache)
    log.info(
        "memguard: MLX memory limit %s, cache limit %s (Metal, under the %s hard limit)",
        format_bytes(memory),
        format_bytes(cache),
        format_bytes(limits.hard_bytes),
    )
