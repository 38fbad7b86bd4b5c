"""The enforcer: every poll, the pool's memory checked against its limits.

What can be given back goes first, what ends work goes last: above the soft
limit MLX's cache of freed buffers is handed back (on the CPU backend it has no
cap and grows while requests decode), and only if memory is still above it is
admission paused and an idle model evicted. Above the hard limit the RAM cache
tier goes next; running requests are ended only if memory is still above it. Each
step reads memory afresh: a step that already got it under never lets the next run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from omlx.engine.admission import AdmissionSwitch
from omlx.errors import MemoryPressureError
from omlx.memory import mlx_stats
from omlx.memory.budget import MemoryReading
from omlx.sizes import format_bytes

if TYPE_CHECKING:
    from omlx.engine.pool_memory import PoolMemory
    from omlx.engine.residents import Residents

log = logging.getLogger(__name__)


class Enforcer:
    """``admission``: the pool's one admission switch, which every step gate reads."""

    def __init__(self, residents: Residents, memory: PoolMemory, admission: AdmissionSwitch):
        self._residents = residents
        self._memory = memory
        self.admission = admission
        # Times memory above the soft limit was met by handing MLX's cache back.
        self.num_reclaims = 0

    @property
    def admission_paused(self) -> bool:
        return self.admission.paused

    @property
    def num_admission_pauses(self) -> int:
        return self.admission.num_pauses

    async def enforce(self) -> None:
        memory, residents = self._memory, self._residents
        memory.publish(residents.engines())
        limits = memory.limits
        used = memory.probe.reading(fresh=True).resident_bytes
        if used > limits.soft_bytes:
            used = await self._reclaim(used, "soft")
        self.admission.set(used > limits.soft_bytes)
        if not self.admission.paused:
            return
        log.warning(
            "memcheck: memory %s above the soft limit %s: admission paused",
            format_bytes(used),
            format_bytes(limits.soft_bytes),
        )
        # Each action is followed by a fresh reading: the next, harsher one (dropping
        # the RAM tier, ending requests) runs only if memory is still over.
        if await residents.evict_one_idle("to get under the soft limit"):
            used = await self._reclaim(used, "soft")
            self.admission.set(used > limits.soft_bytes)
        if used > limits.hard_bytes and memory.hot_cache is not None:
            memory.hot_cache.clear(tier="hot")
            used = await self._reclaim(used, "hard")
        if used > limits.hard_bytes:
            await self._end_all(used)

    async def _reclaim(self, used: int, limit: str) -> int:
        """Hand MLX's free cache (and the RAM tier's freed pages) back; the
        resident bytes after it (a fresh reading either way)."""
        if not self._residents.worker_alive:
            return self._memory.probe.reading(fresh=True).resident_bytes
        reading: MemoryReading = await self._residents.run_on_worker(self._reclaim_on_worker)
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
        return self._memory.probe.reading(fresh=True)

    async def _end_all(self, used: int) -> None:
        error = MemoryPressureError(
            f"memory {format_bytes(used)} passed the "
            f"{format_bytes(self._memory.limits.hard_bytes)} limit: the server ended running "
            "requests to stay safe; retry shortly"
        )
        ended = 0
        for engine in self._residents.engines():
            ended += await self._residents.run_on_worker(engine.fail_all, error)
        log.error(
            "memcheck: memory above the hard limit after handing back caches: ended %d requests",
            ended,
        )
