"""Ollama-compatible model routes on the same port: /api/tags, /api/show, /api/ps,
/api/version; the endpoints omlx does not provide answer what to use instead."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from omlx.api.ollama_format import ollama_name, omlx_name
from omlx.api.ollama_models import ps_entry, read_facts, show_body, tags_entry
from omlx.api.ollama_schemas import ModelRequest
from omlx.api.state import state_of
from omlx.engine.pool import EnginePool
from omlx.errors import ModelNotFoundError, UnsupportedEndpointError

router = APIRouter()

# The Ollama API level these routes follow; clients gate features (tools, think) on it.
OLLAMA_API_VERSION = "0.12.0"


def resolve(pool: EnginePool, requested: str) -> str:
    """The model folder for ``NAME`` or ``NAME:latest``; 404 listing Ollama names."""
    try:
        return pool.resolve(omlx_name(requested)).name
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(requested, [ollama_name(n) for n in exc.available]) from None


# ---- models ---------------------------------------------------------------------------


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    pool = state_of(request).pool
    models = pool.available()
    named = [(models[n], pool.public_name(n)) for n in sorted(models)]
    facts = await asyncio.to_thread(lambda: [read_facts(info, name) for info, name in named])
    return {"models": [tags_entry(f) for f in facts]}


@router.post("/api/show")
async def show(body: ModelRequest, request: Request) -> dict[str, Any]:
    pool = state_of(request).pool
    name = resolve(pool, body.model_name())
    info = pool.available()[name]
    facts = await asyncio.to_thread(read_facts, info, pool.public_name(name))
    return show_body(facts, pool.request_defaults(name).sampling)


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    pool = state_of(request).pool
    models = pool.available()
    entries = []
    for status in pool.status():
        engine = pool.engine(status["name"])
        if engine is None or status["name"] not in models:
            continue
        facts = await asyncio.to_thread(read_facts, models[status["name"]], status["id"])
        expiry = pool.idle_expiry_s(status["name"])
        entries.append(ps_entry(facts, status["memory_bytes"], expiry, engine.context_window))
    return {"models": entries}


# ---- endpoints omlx does not provide ---------------------------------------------------

_INSTEAD = {
    "/api/pull": "omlx does not pull from the Ollama registry; download an MLX model from "
    "Hugging Face with 'omlx pull REPO_ID' or on the admin panel's Models page",
    "/api/push": "omlx does not push models to a registry",
    "/api/create": "omlx does not create models from a Modelfile; put an MLX model folder in "
    "a model dir, import a GGUF with 'omlx models import-gguf FILE', and set a model's "
    "defaults (sampling, alias) in the admin panel",
    "/api/copy": "omlx does not copy models; give a model a second name with an alias in "
    "the admin panel's model settings",
    "/api/delete": "omlx does not delete models over the API; use 'omlx models rm NAME'",
}


def _unsupported(path: str) -> Callable[[], Any]:
    async def refuse() -> None:
        raise UnsupportedEndpointError(_INSTEAD[path])

    return refuse


for _path in _INSTEAD:
    _methods = ["DELETE"] if _path == "/api/delete" else ["POST"]
    router.add_api_route(_path, _unsupported(_path), methods=_methods, include_in_schema=False)
