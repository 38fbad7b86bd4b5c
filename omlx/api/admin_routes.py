"""The admin API (``/admin/api``): models, per-model and global settings, cache, memory.

Every route requires the API key or a login session when a key is set.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from omlx import __version__
from omlx.api import protected_settings
from omlx.api.anthropic_models import check_aliases
from omlx.api.auth import ApiKeyAuth, require_admin
from omlx.api.state import ServerState, state_of
from omlx.cache.hot import ClearTier
from omlx.engine.drafts import check_draft_setting
from omlx.errors import (
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    SettingsError,
)
from omlx.settings import Settings, describe_validation_error, set_file_value

log = logging.getLogger(__name__)

router = APIRouter(prefix="/admin/api", dependencies=[Depends(require_admin)])

# A cache clear past this answers 503 (a slow or stuck disk); the clear itself
# cannot be interrupted and finishes in the background.
CACHE_CLEAR_TIMEOUT_S = 30.0

# Global settings that take effect on the running server when changed; the
# rest are saved and apply at the next start.
LIVE_SETTINGS = frozenset(
    {
        "server.api_key",
        "server.sse_keepalive_s",
        "server.max_body_bytes",
        "server.template_timeout_s",
        "models.default_model",
        "models.idle_timeout_s",
        "models.hf_endpoint",
        "models.hf_token",
        "models.anthropic_aliases",
        "models.image_url_allowlist",
        "sampling.temperature",
        "sampling.top_p",
        "sampling.top_k",
        "sampling.min_p",
        "sampling.repetition_penalty",
        "generation.max_context_window",
        "generation.max_tokens",
    }
)
_SECRET = "server.api_key"


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise InvalidRequestError("the body is not valid UTF-8 (send JSON as UTF-8)") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc.msg}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    return body


def _authenticated(request: Request) -> bool:
    """A key is set and this request proves it: the gate for protected settings."""
    auth: ApiKeyAuth = request.app.state.auth
    return auth.authenticated(request)


def _known_model(state: ServerState, name: str) -> str:
    """The folder name for ``name`` (folder or alias); 404 when unknown."""
    return state.pool.resolve(name).name


# -- server ----------------------------------------------------------------


@router.get("/status")
async def status(request: Request) -> dict[str, Any]:
    state = state_of(request)
    pool = state.pool
    return {
        "version": __version__,
        "auth_enabled": request.app.state.auth.enabled,
        "models": pool.status(),
        "memory": _memory(state),
        "num_loads": pool.num_loads,
        "num_evictions": pool.num_evictions,
    }


# -- models ----------------------------------------------------------------


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"models": state_of(request).pool.status()}


@router.post("/models/{name:path}/load")
async def load_model(name: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    engine = await state.pool.load(name)
    return {"name": engine.name, "state": state.pool.model_state(engine.name)}


@router.post("/models/{name:path}/unload")
async def unload_model(name: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    body = await _json_object(request)
    drain_s = body.get("drain_s", 0.0)
    if not isinstance(drain_s, int | float) or not 0 <= drain_s <= 600:
        raise InvalidRequestError("'drain_s' must be a number of seconds in 0..600")
    folder = _known_model(state, name)
    unloaded = await state.pool.unload(folder, drain_s=float(drain_s))
    return {"name": folder, "unloaded": unloaded, "state": state.pool.model_state(folder)}


@router.get("/models/{name:path}/settings")
async def get_model_settings(name: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    folder = _known_model(state, name)
    return {"name": folder, "settings": state.pool.model_settings.get(folder).model_dump()}


@router.put("/models/{name:path}/settings")
async def put_model_settings(name: str, request: Request) -> dict[str, Any]:
    """Merge the given fields into the model's settings (null clears a field)."""
    state = state_of(request)
    folder = _known_model(state, name)
    changes = await _json_object(request)
    pool = state.pool
    if pool.cluster is not None and changes.get("speculative") is not None:
        raise SettingsError(
            "speculative: speculative decoding is not available while the model is split "
            "across ranks (omlx serve --distributed); leave it null",
            param="speculative",
        )
    check_draft_setting(folder, changes, pool.available())
    saved = pool.model_settings.update(folder, changes, available=list(pool.available()))
    await pool.settings_changed(folder)
    return {"name": folder, "settings": saved.model_dump()}


@router.delete("/models/{name:path}/settings")
async def reset_model_settings(name: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    folder = _known_model(state, name)
    state.pool.model_settings.reset(folder)
    await state.pool.settings_changed(folder)
    return {"name": folder, "settings": state.pool.model_settings.get(folder).model_dump()}


# -- global settings -------------------------------------------------------


def _public_settings(settings: Settings) -> dict[str, Any]:
    data = settings.model_dump(mode="json")
    if data["server"].get("api_key"):
        data["server"]["api_key"] = "***"
    if data["models"].get("hf_token"):
        data["models"]["hf_token"] = "***"
    return data


@router.get("/settings")
async def get_settings(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {
        "settings": _public_settings(state.settings),
        "live": sorted(LIVE_SETTINGS),
        "path": str(state.settings.settings_path),
        **protected_settings.describe(authenticated=_authenticated(request)),
    }


def _flatten(changes: dict[str, Any]) -> dict[str, Any]:
    flat = {}
    for group, fields in changes.items():
        if not isinstance(fields, dict):
            raise InvalidRequestError(
                f"'{group}' must be an object of fields, e.g. {{\"{group}\": {{...}}}}",
                param=group,
            )
        for field, value in fields.items():
            flat[f"{group}.{field}"] = value
    return flat


@router.put("/settings")
async def put_settings(request: Request) -> dict[str, Any]:
    """Validate and save ``{group: {field: value}}``; live fields apply at once."""
    state = state_of(request)
    flat = _flatten(await _json_object(request))
    if not flat:
        raise InvalidRequestError("no settings given")
    settings = state.settings
    # Refuse protected keys and validate everything before writing anything.
    protected_settings.check_settings_change(
        flat, authenticated=_authenticated(request), settings_path=settings.settings_path
    )
    merged = settings.model_dump()
    for key, value in flat.items():
        group, field = key.split(".", 1)
        if group not in merged or not isinstance(merged[group], dict):
            raise SettingsError(f"unknown settings group '{group}'", param=key)
        merged[group][field] = value
    try:
        Settings.model_validate(merged)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from None
    if "models.anthropic_aliases" in flat:
        check_aliases(state.pool, flat["models.anthropic_aliases"])
    for key, value in flat.items():
        set_file_value(settings.base_path, key, value)
    applied, restart = [], []
    for key, value in flat.items():
        group, field = key.split(".", 1)
        if key in LIVE_SETTINGS:
            setattr(getattr(settings, group), field, value)
            applied.append(key)
        else:
            restart.append(key)
    await state.pool.settings_changed()
    return {
        "applied": sorted(applied),
        "restart_required": sorted(restart),
        "settings": _public_settings(settings),
    }


# -- cache -----------------------------------------------------------------


@router.get("/cache/stats")
async def cache_stats(request: Request) -> dict[str, Any]:
    pool = state_of(request).pool
    hot = pool.hot_cache
    models = {e.name: e.prefix_cache.stats() for e in pool.loaded() if e.prefix_cache is not None}
    return {
        "enabled": hot is not None,
        "hot": asdict(hot.stats()) if hot is not None else None,
        "models": models,
    }


async def _clear_every_rank(pool: Any, identity: str | None, tier: ClearTier) -> None:
    """A model split across ranks: its runner's call is replayed on every rank, each
    clearing its own tiers (on the MLX thread, where the ranks' calls are ordered)."""
    for engine in pool.loaded():
        await asyncio.wrap_future(pool.worker.submit(engine.clear_prefix_cache, tier))
    # Rank 0's blocks of a model not loaded now (the loaded one's are gone already).
    await asyncio.to_thread(pool.hot_cache.clear, identity, tier=tier)


async def _stored_first(pool: Any) -> None:
    """Every engine stores the blocks of the requests that just ended (each does it
    at its next step, after the response left), so a request answered just before
    a clear is cleared with the rest."""
    cached = [e for e in pool.loaded() if e.prefix_cache is not None]
    if cached:
        await asyncio.wrap_future(pool.worker.submit(_flush_each, cached))


def _flush_each(engines: list[Any]) -> None:
    for engine in engines:
        engine.flush_cache_stores()


@router.post("/cache/clear")
async def cache_clear(request: Request) -> dict[str, Any]:
    """Body: ``{"tier": "hot" | "ssd" | "both", "model": optional name}``."""
    state = state_of(request)
    body = await _json_object(request)
    tier = body.get("tier", "both")
    if tier not in ("hot", "ssd", "both"):
        raise InvalidRequestError("'tier' must be 'hot', 'ssd' or 'both'", param="tier")
    hot = state.pool.hot_cache
    if hot is None:
        raise NotFoundError("the prefix cache is disabled (cache.enabled=false)")
    identity = None
    if body.get("model"):
        engine = state.pool.engine(_known_model(state, str(body["model"])))
        if engine is None:
            raise InvalidRequestError(
                f"model '{body['model']}' is not loaded; its cache is cleared when it is",
                param="model",
            )
        if engine.prefix_cache is None:  # embedding models, or the cache switched off
            raise InvalidRequestError(
                f"model '{body['model']}' keeps no prefix cache", param="model"
            )
        identity = engine.prefix_cache.identity
    # Off the event loop: the SSD tier flushes its writer (up to seconds) and unlinks files.
    if state.pool.cluster is not None:
        clearing = _clear_every_rank(state.pool, identity, tier)
    else:
        await _stored_first(state.pool)
        clearing = asyncio.to_thread(hot.clear, identity, tier=tier)
    try:
        await asyncio.wait_for(clearing, CACHE_CLEAR_TIMEOUT_S)
    except TimeoutError:
        log.warning(
            "cache clear (tier %s) still running after %.0f s; it finishes in the background",
            tier,
            CACHE_CLEAR_TIMEOUT_S,
        )
        raise ServiceUnavailableError(
            f"clearing the {tier} cache took over {CACHE_CLEAR_TIMEOUT_S:.0f} s (a slow or "
            "busy disk); it goes on in the background: check /admin/api/cache/stats, and "
            "retry the clear if blocks remain",
            retry_after_s=max(1, int(CACHE_CLEAR_TIMEOUT_S)),
        ) from None
    return {"cleared": tier, "model": body.get("model"), "hot": asdict(hot.stats())}


# -- memory ----------------------------------------------------------------


def _memory(state: ServerState) -> dict[str, Any]:
    pool = state.pool
    reading = pool.probe.reading()
    limits = pool.limits
    return {
        "limit_bytes": limits.hard_bytes,
        "soft_limit_bytes": limits.soft_bytes,
        "transient_margin_bytes": limits.transient_margin_bytes,
        "model_budget_bytes": pool.model_budget_bytes,
        "current_bytes": reading.resident_bytes,
        "reading": asdict(reading),
        "guards": {e.name: e.guard.describe() for e in pool.loaded()},
    }


@router.get("/memory")
async def memory(request: Request) -> dict[str, Any]:
    return _memory(state_of(request))


# -- release / resume (also at the top level, as other servers expose them) --

RELEASE_TAGS = frozenset({"weights", "kv_cache"})
memory_router = APIRouter(dependencies=[Depends(require_admin)])


async def _release_body(request: Request) -> tuple[set[str], dict[str, Any]]:
    body = await _json_object(request)
    if body.get("stage_to_cpu"):
        raise InvalidRequestError(
            "stage_to_cpu is not possible here: CPU and GPU share one unified memory, so "
            "there is nowhere else to stage to; release the weights instead",
            param="stage_to_cpu",
        )
    tags = body.get("tags", sorted(RELEASE_TAGS))
    # Strings first: a nested list ([["weights"]]) cannot even go in a set.
    if (
        not isinstance(tags, list)
        or not tags
        or not all(isinstance(t, str) for t in tags)
        or not set(tags) <= RELEASE_TAGS
    ):
        raise InvalidRequestError(
            f"'tags' must be a non-empty list of {sorted(RELEASE_TAGS)}", param="tags"
        )
    return set(tags), body


async def _release(request: Request) -> Any:
    tags, body = await _release_body(request)
    timeout_s = body.get("timeout_s", 30.0)
    number = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
    if not number or not 0 <= timeout_s <= 600:
        raise InvalidRequestError(
            "'timeout_s' must be a number of seconds in 0..600", param="timeout_s"
        )
    report = await state_of(request).pool.release(tags, _model_of(body), float(timeout_s))
    if not report["failed"]:
        return report
    # 500, not 502: the models that failed are this server's own, not an upstream's.
    # The per-model report says what was released; resume restores either way.
    message = "release incomplete: " + "; ".join(f"{n}: {e}" for n, e in report["failed"].items())
    error = {"message": message, "type": "server_error", "code": "release_incomplete"}
    return JSONResponse({"error": error, **report}, status_code=500)


async def _resume(request: Request) -> dict[str, Any]:
    tags, body = await _release_body(request)
    return await state_of(request).pool.resume(tags, _model_of(body))


def _model_of(body: dict[str, Any]) -> str | None:
    """The optional "model" a release or resume is scoped to (default: every model)."""
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidRequestError("'model' must be a model name", param="model")
    return model


for _prefix in ("", "/admin/api/memory"):
    memory_router.add_api_route(
        f"{_prefix}/release_memory_occupation" if not _prefix else f"{_prefix}/release",
        _release,
        methods=["POST"],
    )
    memory_router.add_api_route(
        f"{_prefix}/resume_memory_occupation" if not _prefix else f"{_prefix}/resume",
        _resume,
        methods=["POST"],
    )
