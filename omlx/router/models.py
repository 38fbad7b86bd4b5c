"""The backends' model lists merged: OpenAI's and Anthropic's ``/v1/models``
and Ollama's ``/api/tags``; each model once, with the backends serving it."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import httpx

from omlx.router.backends import POLL_TIMEOUT_S, Backend, BackendSet


def merged_models(backends: BackendSet) -> list[dict[str, Any]]:
    """Each model once (the first backend's entry), with every healthy backend serving it."""
    merged: dict[str, dict[str, Any]] = {}
    for backend in backends.healthy():
        for model in backend.models:
            entry = merged.setdefault(model["id"], {**model, "backends": []})
            entry["backends"].append(backend.url)
    return sorted(merged.values(), key=lambda m: m["id"])


async def merged_tags(client: httpx.AsyncClient, backends: BackendSet) -> list[dict[str, Any]]:
    """Ollama's model list, asked of every healthy backend at once (each name once)."""

    async def tags(backend: Backend) -> list[dict[str, Any]]:
        try:
            reply = await client.get(
                f"{backend.url}/api/tags", headers=backend.auth_headers(), timeout=POLL_TIMEOUT_S
            )
            return list(reply.json()["models"]) if reply.status_code == 200 else []
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return []

    merged: dict[str, dict[str, Any]] = {}
    for rows in await asyncio.gather(*(tags(b) for b in backends.healthy())):
        for row in rows:
            merged.setdefault(str(row.get("name")), row)
    return sorted(merged.values(), key=lambda m: str(m.get("name")))


def openai_list(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": entries}


def anthropic_entry(entry: dict[str, Any]) -> dict[str, Any]:
    created = datetime.fromtimestamp(int(entry.get("created") or 0), tz=UTC)
    return {
        "type": "model",
        "id": entry["id"],
        "display_name": entry["id"],
        "created_at": created.isoformat().replace("+00:00", "Z"),
        "backends": entry["backends"],
    }


def anthropic_page(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Every model on one page (a router fronts a handful of models, not thousands)."""
    data = [anthropic_entry(e) for e in entries]
    return {
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
