"""Hub downloads in the admin API: search, inspect, and download tasks.

Every route requires the API key or a login session when a key is set. Inspecting
and planning talk to the Hub, so they run off the event loop; the downloads
themselves run in child processes (``omlx.models.download_tasks``) and the finished
model appears in the first model dir, and so in /v1/models. ``gguf_file`` downloads one
GGUF of a repo and imports it (phase "importing") instead.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from omlx.api.auth import require_admin
from omlx.api.fit_routes import live_baseline_bytes
from omlx.api.state import state_of
from omlx.models.downloads import search_summary

router = APIRouter(prefix="/admin/api", dependencies=[Depends(require_admin)])


class InspectBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    repo_id: str = Field(min_length=1)
    revision: str | None = None


class DownloadBody(InspectBody):
    name: str | None = None
    # A GGUF import: download this .gguf of the repo, then convert it into the folder.
    gguf_file: str | None = Field(None, min_length=1)
    dtype: Literal["float32", "float16", "keep"] | None = None


@router.get("/hub/search")
async def hub_search(
    request: Request, q: str = "", limit: int = Query(20, ge=1, le=100)
) -> dict[str, Any]:
    state = state_of(request)
    baseline = live_baseline_bytes(state.pool)
    results = await asyncio.to_thread(search_summary, state.settings, q, limit, baseline)
    return {"results": results}


@router.post("/models/downloads/inspect")
async def inspect(body: InspectBody, request: Request) -> dict[str, Any]:
    state = state_of(request)
    baseline = live_baseline_bytes(state.pool)
    downloads = state.downloads
    return await asyncio.to_thread(downloads.inspect, body.repo_id, body.revision, baseline)


@router.post("/models/downloads", status_code=201)
async def start_download(body: DownloadBody, request: Request) -> dict[str, Any]:
    state = state_of(request)
    baseline = live_baseline_bytes(state.pool)
    task = await asyncio.to_thread(
        state.downloads.submit,
        body.repo_id,
        body.revision,
        body.name,
        baseline,
        gguf_file=body.gguf_file,
        dtype=body.dtype,
    )
    return {"task": task}


@router.get("/models/downloads")
async def list_downloads(request: Request) -> dict[str, Any]:
    return {"downloads": state_of(request).downloads.list()}


@router.get("/models/downloads/{task_id}")
async def get_download(task_id: str, request: Request) -> dict[str, Any]:
    return state_of(request).downloads.get(task_id)


@router.post("/models/downloads/{task_id}/cancel")
async def cancel_download(task_id: str, request: Request) -> dict[str, Any]:
    # Waits (off the event loop) until the worker child is gone.
    return await asyncio.to_thread(state_of(request).downloads.cancel, task_id)


@router.delete("/models/downloads/{task_id}", status_code=204)
async def delete_download(task_id: str, request: Request) -> Response:
    state_of(request).downloads.delete(task_id)
    return Response(status_code=204)
