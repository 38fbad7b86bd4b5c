"""``POST /admin/api/models/fit``: will a discovered model, or a local folder, fit?

The body names one of ``{"model": NAME}`` or ``{"path": "/abs/dir"}``. The
answer is ``omlx.memory.fit``'s estimate under the running settings, with the
live idle baseline (runtime and other loaded models) already counted.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from omlx.api.auth import require_admin
from omlx.api.state import state_of
from omlx.engine.pool import EnginePool
from omlx.errors import InvalidRequestError
from omlx.memory.fit import fit_for_settings, native_context_tokens
from omlx.models.model_settings import effective_context_window

__all__ = ["FitBody", "live_baseline_bytes", "router"]

router = APIRouter(prefix="/admin/api", dependencies=[Depends(require_admin)])


class FitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, min_length=1)
    path: str | None = None


def live_baseline_bytes(pool: EnginePool, *, excluding: str | None = None) -> int:
    """What the server holds with nothing in flight; a loaded ``excluding`` model's
    weights are taken out, so the model being estimated is not counted twice."""
    baseline = pool.baseline.bytes_now(pool.probe.reading())
    engine = pool.engine(excluding) if excluding is not None else None
    if engine is not None:
        baseline -= engine.loaded.info.size_bytes
    return max(0, baseline)


@router.post("/models/fit")
async def model_fit(body: FitBody, request: Request) -> dict[str, Any]:
    state = state_of(request)
    if (body.model is None) == (body.path is None):
        raise InvalidRequestError('give exactly one of "model" (a model name) or "path" (a folder)')
    name, own_window, kv_quant = None, None, None
    if body.model is not None:
        info = state.pool.resolve(body.model)  # 404 naming the models that exist
        folder, name = info.path, info.name
        own = state.pool.model_settings.get(name)
        own_window = own.max_context_window
        spec = own.kv_quant
        kv_quant = (spec.bits, spec.group_size) if spec is not None else None
    else:
        folder = _model_folder(body.path)
    config, weights = await asyncio.to_thread(_read_model, folder)
    settings = state.settings
    context = None
    if own_window is not None:  # the model's own cap, as the pool applies it
        context = effective_context_window(
            own_window, settings.generation.max_context_window, native_context_tokens(config)
        )
    baseline = live_baseline_bytes(state.pool, excluding=name)
    fit = fit_for_settings(
        config,
        weights,
        settings,
        baseline_bytes=baseline,
        context_tokens=context,
        device_cap=state.pool.memory.device_cap,
        kv_quant=kv_quant,
    )
    return fit.as_dict()


def _model_folder(path: object) -> Path:
    if not isinstance(path, str) or not path.strip():
        raise InvalidRequestError("'path' must be a folder path", param="path")
    folder = Path(path).expanduser()
    if not folder.is_absolute():
        raise InvalidRequestError(f"'path' must be absolute, got {path!r}", param="path")
    if not folder.is_dir():
        raise InvalidRequestError(f"no folder at {folder}", param="path")
    return folder


def _read_model(folder: Path) -> tuple[dict[str, Any], int]:
    """config.json and the safetensors weights' total size; 400 naming what is missing."""
    hint = "a model folder holds config.json and *.safetensors weights"
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidRequestError(
            f"not a model folder: no config.json in {folder} ({hint})", param="path"
        ) from None
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(
            f"unreadable config.json in {folder}: {exc}", param="path"
        ) from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"{folder}/config.json is not a JSON object", param="path")
    try:
        weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    except OSError as exc:  # e.g. a dangling symlink into a deleted cache
        raise InvalidRequestError(f"unreadable weights in {folder}: {exc}", param="path") from None
    if not weights:
        raise InvalidRequestError(
            f"not a model folder: no safetensors weights in {folder} ({hint})", param="path"
        )
    return config, weights
