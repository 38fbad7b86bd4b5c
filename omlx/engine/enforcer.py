"""The enforcer: every poll, the pool's memory checked against its limits.

What can be given back goes first, what ends work goes last: above the soft
limit MLX's cache of freed buffers is handed back (on the CPU backend it has no
cap and grows while requests decode), and only if memory is still above it is
admission paused and an idle model evicted. Above the hard limit the RAM cache
tier goes next; running requests are ended only if memory is still above it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from omlx.errors import MemoryPressureError
from omlx.memory import mlx_stats
from omlx.memory.budget import MemoryReading
from omlx.sizes import format_bytes

if TYPE_CHECKING:
    from omlx.engine.pool import EnginePool

log = logging.getLogger(__name__)


class Enforcer:
    def __init__(self, pool: EnginePool):
        self._pool = pool
        # Above the soft limit admission pauses: now, and how often it started.
        self.admission_paused = False
        self.num_admission_pauses = 0
        # Times memory above the soft limit was met by handing MLX's cache back.
        self.num_reclaims = 0

    async def enforce(self) -> None:
        pool = self._pool
        pool.publish_limits()
        limits = pool.limits
        used = pool.probe.reading(fresh=True).resident_bytes
        if used > limits.soft_bytes:
            used = await self._reclaim(used, "soft")
        self._pause(used > limits.soft_bytes)
        if not self.admission_paused:
            return
        log.warning(
            "memcheck: memory %s above the soft limit %s: admission paused",
            format_bytes(used),
            format_bytes(limits.soft_bytes),
        )
        await pool.evict_one_idle("to get under the soft limit")
        if used > limits.hard_bytes and pool.hot_cache is not None:
            pool.hot_cache.clear(tier="hot")
            used = await self._reclaim(used, "hard")
        if used > limits.hard_bytes:
            await self._end_all(used)

    def _pause(self, paused: bool) -> None:
        if paused and not self.admission_paused:
            self.num_admission_pauses += 1
        self.admission_paused = paused
        for engine in self._pool.loaded():
            engine.admission_paused = paused

    async def _reclaim(self, used: int, limit: str) -> int:
        """Hand MLX's free cache (and the RAM tier's freed pages) back; the
        resident bytes after it."""
        worker = self._pool.worker
        if not worker.is_alive:
            return used
        reading: MemoryReading = await asyncio.wrap_future(worker.submit(self._reclaim_on_worker))
        self.num_reclaims += 1
        log.info(
            "memcheck: memory %s above the %s limit: freed buffers handed back, now %s",
            format_bytes(used),
            limit,
            format_bytes(reading.resident_bytes),
        )
        return reading.resident_bytes

    def _reclaim_on_worker(self) -> MemoryReading:
        mlx_stats.release_cache()
        return self._pool.probe.reading(fresh=True)

    async def _end_all(self, used: int) -> None:
        pool = self._pool
        error = MemoryPressureError(
            f"memory {format_bytes(used)} passed the {format_bytes(pool.limits.hard_bytes)} "
            "limit: the server ended running requests to stay safe; retry shortly"
        )
        ended = 0
        for engine in pool.loaded():
            ended += await asyncio.wrap_future(pool.worker.submit(engine.fail_all, error))
        log.error(
            "memcheck: memory above the hard limit after handing back caches: ended %d requests",
            ended,
        )
