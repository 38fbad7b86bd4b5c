"""The distributed group (``omlx serve --distributed``): ``/admin/api/cluster`` lists
each rank with its memory (the admin panel's Cluster view), and ``/health`` carries
the same report so a lost rank shows there too."""

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
    return {"distributed": pool.cluster.status(reading, pool.limits.hard_bytes)}


@router.get("/cluster")
async def cluster(request: Request) -> dict[str, Any]:
    """Each rank's state and memory; ``{"distributed": null}`` on a one-process server."""
    pool = state_of(request).pool
    report = cluster_health(pool, pool.probe.reading())
    return {"distributed": report.get("distributed")}
