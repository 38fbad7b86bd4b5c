"""The distributed group (``omlx serve --distributed``): ``/admin/api/cluster`` lists
each rank with its memory and prefix-cache counters (the admin panel's Cluster view),
and ``/health`` carries the same report so a lost rank shows there too."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from omlx.api.auth import require_admin
from omlx.api.state import state_of
from omlx.engine.pool import EnginePool
from omlx.memory.budget import MemoryReading

router = APIRouter(prefix="/admin/api", dependencies=[Depends(require_admin)])


def cluster_health(pool: EnginePool, reading: MemoryReading) -> dict[str, Any]:
    """``{"distributed": report}`` when this server is rank 0 of a group, else {}."""
    if pool.cluster is None:
        return {}
    engine = pool.engine(pool.cluster.model)
    prefix = getattr(engine, "prefix_cache", None)
    cache = prefix.stats() if prefix is not None else None
    return {"distributed": pool.cluster.status(reading, pool.limits.hard_bytes, cache)}


@router.get("/cluster")
async def cluster(request: Request) -> dict[str, Any]:
    """Each rank's state and memory; ``{"distributed": null}`` on a one-process server."""
    pool = state_of(request).pool
    report = cluster_health(pool, pool.probe.reading())
    return {"distributed": report.get("distributed")}
