"""``GET /metrics`` (Prometheus text) and ``GET /admin/api/stats`` (the dashboard's
JSON), both behind the admin auth when an API key is set."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from omlx.api.auth import require_admin
from omlx.api.metrics import RequestMetricsMiddleware, ServerMetrics
from omlx.api.metrics_collector import PoolCollector, stats_body, take_snapshot
from omlx.api.state import ServerState, state_of

router = APIRouter(dependencies=[Depends(require_admin)])


def _metrics(request: Request) -> ServerMetrics:
    metrics: ServerMetrics = request.app.state.metrics
    return metrics


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    body = generate_latest(_metrics(request).registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/admin/api/stats")
async def stats(request: Request) -> dict[str, Any]:
    m = _metrics(request)
    return stats_body(take_snapshot(state_of(request), m), m)


def install_metrics(app: FastAPI) -> ServerMetrics:
    """Counters for this app: a registry of its own, the counting middleware (add
    it last, so it is outermost and sees every status) and the two routes."""
    state: ServerState = app.state.omlx
    metrics = ServerMetrics()
    metrics.registry.register(PoolCollector(state, metrics))
    app.state.metrics = metrics
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    app.include_router(router)
    return metrics
