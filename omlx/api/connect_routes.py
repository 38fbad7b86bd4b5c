"""``GET /admin/api/connect``: what each coding agent needs to talk to this server
(the admin panel's Connect page), from the same plans ``omlx launch`` runs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from omlx.agent_context import context_warning
from omlx.api.auth import require_admin
from omlx.api.state import state_of
from omlx.launch import TOOLS, Connection, launch_plan

router = APIRouter(prefix="/admin/api", dependencies=[Depends(require_admin)])

# The key itself is never sent to the page: the user pastes their own.
KEY_SHOWN = "<your omlx API key>"


@router.get("/connect")
async def connect(request: Request, model: str | None = None) -> dict[str, Any]:
    state = state_of(request)
    pool = state.pool
    # Coding agents chat: embedding and rerank models are not offered.
    names = sorted(n for n, info in pool.available().items() if info.kind in ("llm", "vlm"))
    window = None
    if model is None:
        default = pool.default_model()
        model = default if default in names else (names[0] if names else None)
    if model is not None:
        info = pool.resolve(model)  # 404 naming the models that exist
        model, window = pool.public_name(info.name), pool.context_window(info)
    base_url = str(request.base_url).rstrip("/")
    has_key = bool(state.settings.server.api_key)
    conn = Connection(base_url, KEY_SHOWN if has_key else None, model or "MODEL", window)
    tools = []
    for tool in TOOLS:
        plan = launch_plan(tool, conn)
        tools.append(
            {
                "tool": tool,
                "env": plan.env,
                "shell": "\n".join(plan.shell_lines()),
                "launch": f"omlx launch {tool}",
                "install": plan.install_hint,
                # The model's window is too small for what the tool sends (None: fine).
                "warning": context_warning(tool, conn.model, window),
            }
        )
    return {
        "base_url": base_url,
        "openai_base_url": f"{base_url}/v1",
        "model": conn.model,
        "context_window": window,
        "models": [pool.public_name(n) for n in names],
        "api_key_required": has_key,
        "tools": tools,
    }
