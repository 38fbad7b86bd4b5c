"""Model names for Anthropic clients: ``models.anthropic_aliases`` (Claude Code asks
for "claude-sonnet-4-5") and /v1/models in Anthropic's shape."""

from __future__ import annotations

import fnmatch
from datetime import UTC, datetime
from typing import Any

from omlx.engine.pool import EnginePool
from omlx.errors import InvalidRequestError, ModelNotFoundError, NotFoundError, SettingsError
from omlx.models.discovery import ModelInfo

ALIASES_KEY = "models.anthropic_aliases"
# Anthropic's page size when a models list names no limit, and its cap.
DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 1000


def served_model(pool: EnginePool, requested: str) -> str:
    """The name to ask the pool for: ``requested`` itself when it is a served model
    or alias (those win), else the target of the first alias pattern it matches."""
    try:
        pool.resolve(requested)
        return requested
    except ModelNotFoundError:
        match = _matching_alias(pool, requested)
        if match is None:
            raise
    pattern, target = match
    if target is None or not _is_served(pool, target):
        raise NotFoundError(
            f"The model '{requested}' matches {ALIASES_KEY}['{pattern}'], whose target "
            f"{_describe(target)} is not a served model; set it to one of "
            f"{_served_names(pool)} (empty: the default model)",
            param="model",
            code="model_not_found",
        )
    return target


def _matching_alias(pool: EnginePool, requested: str) -> tuple[str, str | None] | None:
    """(pattern, local model) of the longest (most specific) pattern ``requested``
    matches; the target is None when it names no model and no default exists."""
    aliases = pool.settings.models.anthropic_aliases
    matches = [p for p in aliases if fnmatch.fnmatchcase(requested, p)]
    if not matches:
        return None
    pattern = max(matches, key=len)
    return pattern, aliases[pattern] or _default_model(pool)


def _default_model(pool: EnginePool) -> str | None:
    """models.default_model, else the only (or first) chat model served."""
    default = pool.default_model()
    if default is not None:
        return default
    models = pool.available()
    chat = [name for name, info in sorted(models.items()) if info.kind == "llm"]
    names = chat or sorted(models)
    return names[0] if names else None


def _is_served(pool: EnginePool, name: str) -> bool:
    try:
        pool.resolve(name)
    except ModelNotFoundError:
        return False
    return True


def _served_names(pool: EnginePool) -> str:
    names = sorted(pool.public_name(n) for n in pool.available())
    return ", ".join(names) if names else "none (no model folder is served)"


def _describe(target: str | None) -> str:
    return f"'{target}'" if target is not None else "(the default model; none is served)"


def check_aliases(pool: EnginePool, aliases: Any) -> None:
    """Admin settings change: every explicit target must be a served model (400
    naming the setting otherwise); the shape itself is the settings model's check."""
    if not isinstance(aliases, dict):
        return
    for pattern, target in aliases.items():
        if isinstance(target, str) and target.strip() and not _is_served(pool, target.strip()):
            raise SettingsError(
                f"invalid setting '{ALIASES_KEY}': the target '{target}' of pattern "
                f"'{pattern}' is not a served model; use one of {_served_names(pool)}, "
                "or an empty target for the default model",
                param=ALIASES_KEY,
            )


# ---- /v1/models for Anthropic clients (an anthropic-version header) --------------


def model_entry(pool: EnginePool, info: ModelInfo) -> dict[str, Any]:
    created = datetime.fromtimestamp(int(info.path.stat().st_mtime), tz=UTC)
    name = pool.public_name(info.name)
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": created.isoformat().replace("+00:00", "Z"),
    }


def model_page(pool: EnginePool, query: dict[str, str]) -> dict[str, Any]:
    """One page of the models list, as Anthropic pages it (limit, after_id, before_id)."""
    models = pool.available()
    entries = [model_entry(pool, models[n]) for n in sorted(models)]
    ids = [e["id"] for e in entries]
    limit = _limit(query.get("limit"))
    if "after_id" in query:
        start = _position(ids, query["after_id"], "after_id") + 1
        page = entries[start : start + limit]
        more = start + limit < len(entries)
    elif "before_id" in query:
        end = _position(ids, query["before_id"], "before_id")
        page = entries[max(0, end - limit) : end]
        more = end - limit > 0
    else:
        page, more = entries[:limit], limit < len(entries)
    return {
        "data": page,
        "has_more": more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIST_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise InvalidRequestError(
            f"limit must be a whole number in 1..{MAX_LIST_LIMIT} (got {raw!r})", param="limit"
        )
    return int(raw)


def _position(ids: list[str], model_id: str, param: str) -> int:
    if model_id not in ids:
        raise InvalidRequestError(f"{param} '{model_id}' is not a listed model id", param=param)
    return ids.index(model_id)
