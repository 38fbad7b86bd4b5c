"""create_app: the FastAPI application over an EnginePool."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware

from omlx import __version__
from omlx.api.errors import install_error_handlers
from omlx.api.openai_routes import router as openai_router
from omlx.api.state import ServerState
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
        yield
        await pool.close()

    app = FastAPI(title="omlx", version=__version__, lifespan=lifespan)
    app.state.omlx = ServerState(settings, pool)
    if settings.server.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.server.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    install_error_handlers(app)
    app.include_router(openai_router)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        state: ServerState = request.app.state.omlx
        reading = state.pool.probe.reading()
        limits = state.pool.limits
        return {
            "status": "ok",
            "version": __version__,
            "memory": {
                "limit_bytes": limits.hard_bytes,
                "soft_limit_bytes": limits.soft_bytes,
                "current_bytes": reading.resident_bytes,
            },
            "loaded_models": [
                {
                    "name": e.name,
                    "requests_in_flight": e.num_in_flight,
                    "finished": dict(e.finish_counts),
                }
                for e in state.pool.loaded()
            ],
        }

    return app
