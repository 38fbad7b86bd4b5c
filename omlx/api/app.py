"""create_app: the FastAPI application over an EnginePool."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request

from omlx import __version__
from omlx.api.admin_routes import memory_router
from omlx.api.admin_routes import router as admin_router
from omlx.api.anthropic_routes import router as anthropic_router
from omlx.api.auth import ApiKeyAuth, login_router, require_admin, require_api_key
from omlx.api.body_guard import BodyGuardMiddleware
from omlx.api.cluster_routes import cluster_health
from omlx.api.cluster_routes import router as cluster_router
from omlx.api.connect_routes import router as connect_router
from omlx.api.download_routes import router as download_router
from omlx.api.embedding_routes import router as embedding_router
from omlx.api.errors import install_error_handlers
from omlx.api.fit_routes import router as fit_router
from omlx.api.ollama_embed_routes import router as ollama_embed_router
from omlx.api.ollama_model_routes import router as ollama_model_router
from omlx.api.ollama_routes import router as ollama_router
from omlx.api.openai_routes import router as openai_router
from omlx.api.origin_guard import OriginGuardMiddleware, PathScopedCORS
from omlx.api.quant_routes import router as quant_router
from omlx.api.responses_routes import router as responses_router
from omlx.api.responses_store import ResponseStore
from omlx.api.state import ServerState
from omlx.api.stats_routes import install_metrics
from omlx.api.web_routes import install_web
from omlx.engine.engine_status import kv_bits, kv_dims, quantized_kv_start
from omlx.engine.pool import EnginePool
from omlx.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings, pool: EnginePool) -> FastAPI:
    """The pool's worker must be running; the app unloads models on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        models = pool.available()
        log.info(
            "serving %d model(s) from %s: %s",
            len(models),
            ", ".join(str(d) for d in pool.model_dirs),
            ", ".join(sorted(models)) or "-",
        )
        maintenance = asyncio.create_task(
            pool.maintain(min(5.0, settings.memory.poll_interval_s)), name="pool-maintenance"
        )
        pool.startup.begin()  # the default and pinned models, in the background
        await asyncio.to_thread(app.state.omlx.downloads.start)  # resumes unfinished ones
        yield
        await pool.startup.cancel()
        await asyncio.to_thread(app.state.omlx.quant_tasks.shutdown)  # ends a running child
        await asyncio.to_thread(app.state.omlx.downloads.shutdown)  # kept to resume
        maintenance.cancel()
        app.state.omlx.compile_pool.shutdown()
        await pool.close()

    # No /docs or /redoc: they load Swagger UI from a CDN into the admin origin.
    app = FastAPI(
        title="omlx",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.omlx = ServerState(settings, pool)
    # Stored Responses API responses (store: true), kept across restarts.
    app.state.responses = ResponseStore(
        settings.base_path / "responses.db",
        max_responses=settings.server.responses_store_max_count,
        max_bytes=settings.server.responses_store_max_bytes,
    )
    # Read through the settings object: the admin API can change the key live.
    app.state.auth = ApiKeyAuth(lambda: settings.server.api_key)
    app.add_middleware(BodyGuardMiddleware, limit_fn=lambda: settings.server.max_body_bytes)
    if settings.server.cors_origins:
        app.add_middleware(PathScopedCORS, origins=settings.server.cors_origins)
    install_error_handlers(app)
    install_metrics(app)  # counts every response that passed the origin guard
    # Added last, so outermost: a foreign Host or cross-site request reaches nothing.
    app.add_middleware(
        OriginGuardMiddleware,
        bind_host=settings.server.host,
        allowed_hosts_fn=lambda: settings.server.allowed_hosts,
        cors_origins_fn=lambda: settings.server.cors_origins,
    )
    api_key = [Depends(require_api_key)]
    app.include_router(openai_router, dependencies=api_key)
    app.include_router(anthropic_router, dependencies=api_key)
    app.include_router(responses_router, dependencies=api_key)
    app.include_router(ollama_router, dependencies=api_key)
    app.include_router(ollama_model_router, dependencies=api_key)
    app.include_router(embedding_router, dependencies=api_key)
    app.include_router(ollama_embed_router, dependencies=api_key)
    app.include_router(login_router())
    app.include_router(admin_router)
    app.include_router(memory_router)
    app.include_router(quant_router)
    app.include_router(fit_router)
    app.include_router(cluster_router)
    app.include_router(download_router)
    app.include_router(connect_router)
    install_web(app, settings)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(require_admin)])
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        state: ServerState = request.app.state.omlx
        reading = state.pool.probe.reading()
        limits = state.pool.limits
        return {
            # "ok" whenever the server answers; models_state says whether the models
            # loading at start are ready (models: loading / ready / failed, with reasons).
            "status": "ok",
            **state.pool.startup.report(),
            "version": __version__,
            "memory": {
                "limit_bytes": limits.hard_bytes,
                "soft_limit_bytes": limits.soft_bytes,
                "current_bytes": reading.resident_bytes,
                # The GPU's cap under which the limit was resolved (null: CPU backend).
                "metal_cap_bytes": state.pool.memory.device_cap.cap_bytes,
            },
            "loaded_models": [
                {
                    "name": e.name,
                    "requests_in_flight": e.num_in_flight,
                    "finished": dict(e.finish_counts),
                    "kv_bits": kv_bits(e),
                    "quantized_kv_start": quantized_kv_start(e),
                    # What the memory guard prices each request at (null: no KV).
                    "dims": kv_dims(e),
                }
                for e in state.pool.loaded()
            ],
            # Split across ranks (omlx serve --distributed): each rank, alive or lost.
            **cluster_health(state.pool, reading),
        }

    return app
