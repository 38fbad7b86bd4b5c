"""The router's FastAPI app: inference routes proxied to a backend, the merged
model list, memory-control fan-out, ``/metrics`` and ``/health``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from omlx.api.auth import ApiKeyAuth, require_api_key
from omlx.api.body_guard import BodyGuardMiddleware
from omlx.api.errors import install_error_handlers
from omlx.api.origin_guard import OriginGuardMiddleware
from omlx.api.panel_files import resolve_web_dir, serve_panel_files
from omlx.errors import InvalidRequestError, ModelNotFoundError
from omlx.router.affinity import AffinityTable
from omlx.router.backends import Backend, BackendSet
from omlx.router.config import RouterConfig
from omlx.router.fanout import FANOUT_PATHS, fan_out, split_targets, summary
from omlx.router.metrics import router_registry
from omlx.router.models import (
    anthropic_entry,
    anthropic_page,
    merged_models,
    merged_tags,
    openai_list,
)
from omlx.router.proxy import Proxy

log = logging.getLogger(__name__)

# Inference routes of the OpenAI, Anthropic, Responses and Ollama APIs.
PROXIED_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/responses/input_tokens",
    "/v1/embeddings",
    "/api/chat",
    "/api/generate",
    "/api/embed",
    "/api/embeddings",
)


def _client(config: RouterConfig) -> httpx.AsyncClient:
    # No read timeout: a long prefill or generation is the client's to give up on.
    timeout = httpx.Timeout(connect=config.connect_timeout_s, read=None, write=60.0, pool=None)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


@dataclass(frozen=True, slots=True)
class RouterState:
    config: RouterConfig
    client: httpx.AsyncClient
    backends: BackendSet
    affinity: AffinityTable
    proxy: Proxy
    registry: CollectorRegistry


def state_of(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


def create_router_app(config: RouterConfig) -> FastAPI:
    client = _client(config)
    backends = BackendSet(config, client)
    affinity = AffinityTable(config.affinity_max_entries)
    proxy = Proxy(config, backends, affinity, client)
    state = RouterState(
        config, client, backends, affinity, proxy, router_registry(backends, affinity, proxy.stats)
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backends.poll_all()  # models known before the first request
        for backend in backends.backends:
            health = "healthy" if backend.healthy else f"down ({backend.error})"
            log.info("backend %s: %s, models: %s", backend.url, health, sorted(backend.model_ids))
        polling = asyncio.create_task(backends.poll_forever(), name="router-poll")
        yield
        polling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await polling
        await client.aclose()

    app = FastAPI(
        title="omlx router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.auth = ApiKeyAuth(lambda: config.api_key)
    app.state.router = state
    app.add_middleware(BodyGuardMiddleware, limit_fn=lambda: config.max_body_bytes)
    install_error_handlers(app)
    # Outermost: a foreign Host or a cross-site request reaches nothing (see origin_guard).
    app.add_middleware(
        OriginGuardMiddleware,
        bind_host=config.host,
        allowed_hosts_fn=lambda: [],
        cors_origins_fn=lambda: [],
    )
    app.include_router(routes)
    app.get("/health")(health)  # open, as omlx's own
    serve_panel_files(app, resolve_web_dir())  # the admin panel's Backends page
    return app


routes = APIRouter(dependencies=[Depends(require_api_key)])


async def forward(request: Request) -> Response:
    return await state_of(request).proxy.forward(request)


async def stored_response(request: Request, response_id: str) -> Response:
    return await state_of(request).proxy.forward_stored(request, response_id)


for _path in PROXIED_PATHS:
    routes.add_api_route(_path, forward, methods=["POST"])
for _path, _methods in (
    ("/v1/responses/{response_id}", ["GET", "DELETE"]),
    ("/v1/responses/{response_id}/input_items", ["GET"]),
    ("/v1/responses/{response_id}/cancel", ["POST"]),
):
    routes.add_api_route(_path, stored_response, methods=_methods)


@routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    entries = merged_models(state_of(request).backends)
    return anthropic_page(entries) if _anthropic(request) else openai_list(entries)


@routes.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> dict[str, Any]:
    entries = merged_models(state_of(request).backends)
    entry = next((e for e in entries if e["id"] == model_id), None)
    if entry is None:
        raise ModelNotFoundError(model_id, [e["id"] for e in entries])
    return anthropic_entry(entry) if _anthropic(request) else entry


@routes.get("/api/tags")
async def ollama_tags(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {"models": await merged_tags(state.client, state.backends)}


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(state_of(request).registry), media_type=CONTENT_TYPE_LATEST)


async def health(request: Request) -> JSONResponse:
    backends = state_of(request).backends.backends
    healthy = sum(1 for b in backends if b.healthy)
    body = {
        "status": "ok" if healthy else "no healthy backend",
        "healthy": healthy,
        "total": len(backends),
        "backends": [backend_row(b) for b in backends],
    }
    return JSONResponse(body, status_code=200 if healthy else 503)


async def memory_control(request: Request) -> JSONResponse:
    """Release or resume on the backends (see fanout); 200 only if all succeeded."""
    state = state_of(request)
    targets, forwarded = split_targets(await _json_body(request), state.backends)
    path = request.url.path
    outcomes = await fan_out(state.client, targets, path, forwarded, state.config.fanout_timeout_s)
    if path == "/release_memory_occupation":
        for outcome in outcomes:  # its prefix cache may be gone: affinity is stale
            if outcome.ok:
                state.affinity.forget_backend(outcome.backend)
    status, report = summary(outcomes, path)
    return JSONResponse(report, status_code=status)


for _path in FANOUT_PATHS:
    routes.add_api_route(_path, memory_control, methods=["POST"])


def backend_row(backend: Backend) -> dict[str, Any]:
    return {
        "url": backend.url,
        "healthy": backend.healthy,
        "error": backend.error,
        "models": sorted(backend.model_ids),
        "in_flight": backend.num_in_flight,
        "requests_in_flight": backend.load.requests_in_flight,
        "queue_depth": backend.load.queue_depth,
        "memory_headroom_bytes": backend.load.headroom_bytes,
        "requests_routed": backend.num_routed,
        "checked_s_ago": round(time.monotonic() - backend.checked_at, 3)
        if backend.checked_at
        else None,
    }


def _anthropic(request: Request) -> bool:
    """Anthropic's SDK sends this header; it gets the models in Anthropic's shape."""
    return "anthropic-version" in request.headers


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise InvalidRequestError("request body is not valid JSON") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return body
