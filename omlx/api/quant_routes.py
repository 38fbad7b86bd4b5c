"""The oQ quantization admin API (``/admin/api/quant``): levels, estimate, tasks.

Every route requires the API key or a login session when a key is set. Tasks
run one at a time in a child process (``omlx.quant.tasks``); the new model
appears in the first model dir, and so in /v1/models, when its task is done.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from omlx.api.auth import require_admin
from omlx.api.state import state_of
from omlx.quant.estimate import estimate
from omlx.quant.levels import DEFAULT_GROUP_SIZE, LEVELS

router = APIRouter(prefix="/admin/api/quant", dependencies=[Depends(require_admin)])


class EstimateBody(BaseModel):
    model: str = Field(min_length=1)
    level: str
    group_size: int = DEFAULT_GROUP_SIZE


class TaskBody(EstimateBody):
    output_name: str | None = None


@router.get("/levels")
async def levels() -> dict[str, Any]:
    """Targets for 16-bit source weights at the default group size (the estimate
    gives a given model's: float32 sources pay twice the scale overhead)."""
    return {
        "levels": [
            {
                "name": level.name,
                "target_bits_per_weight": level.target_bits_per_weight(DEFAULT_GROUP_SIZE),
            }
            for level in LEVELS.values()
        ]
    }


@router.post("/estimate")
async def estimate_route(body: EstimateBody, request: Request) -> dict[str, Any]:
    info = state_of(request).pool.resolve(body.model)
    found = await asyncio.to_thread(estimate, info.name, info.path, body.level, body.group_size)
    return found.to_dict()


@router.post("/tasks", status_code=201)
async def start_task(body: TaskBody, request: Request) -> dict[str, Any]:
    state = state_of(request)
    info = state.pool.resolve(body.model)
    return state.quant_tasks.submit(
        info.name,
        info.path,
        body.level,
        body.group_size,
        body.output_name,
        trust_remote_code=info.trust_remote_code,
    )


@router.get("/tasks")
async def list_tasks(request: Request) -> dict[str, Any]:
    return {"tasks": state_of(request).quant_tasks.list()}


@router.get("/tasks/{task_id}")
async def get_task(task_id: str, request: Request) -> dict[str, Any]:
    return state_of(request).quant_tasks.get(task_id)


@router.post("/tasks/{task_id}/cancel")
async def cancel_task(task_id: str, request: Request) -> dict[str, Any]:
    # Waits (off the event loop) until the child is gone and its partial folder removed.
    return await asyncio.to_thread(state_of(request).quant_tasks.cancel, task_id)


@router.delete("/tasks/{task_id}")
async def delete_task(task_id: str, request: Request) -> dict[str, Any]:
    state_of(request).quant_tasks.delete(task_id)
    return {"deleted": task_id}
