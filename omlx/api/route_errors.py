"""404 and 405 on the API paths (/v1/...): the OpenAI error envelope, naming the
endpoints that exist, instead of a bare "Not Found"."""

from __future__ import annotations

from typing import Any

from fastapi import Request

API_PREFIX = "/v1/"
# Starlette's own details: a handler's explicit 404 (e.g. an unknown model) keeps its message.
_ROUTER_DETAILS = {404: "Not Found", 405: "Method Not Allowed"}
_METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE"}


def is_routing_error(request: Request, status: int, detail: Any) -> bool:
    """Whether a 404/405 came from the router on an API path (not from a handler)."""
    return request.url.path.startswith(API_PREFIX) and _ROUTER_DETAILS.get(status) == detail


def api_endpoints(request: Request) -> list[str]:
    """``"POST /v1/chat/completions"``-style lines for every API route of the app,
    from its OpenAPI description (FastAPI builds it once and caches it)."""
    paths = request.app.openapi().get("paths", {})
    return [
        f"{method.upper()} {path}"
        for path in sorted(paths)
        if path.startswith(API_PREFIX)
        for method in sorted(paths[path])
        if method.upper() in _METHODS
    ]


def routing_error(request: Request, status: int, allow: str | None) -> tuple[str, str]:
    """The message and code of a router 404 or 405 on an API path."""
    asked = f"{request.method} {request.url.path}"
    if status == 405:
        methods = ", ".join(m.strip() for m in (allow or "").split(",") if m.strip() != "HEAD")
        return (
            f"method not allowed: {asked}; {request.url.path} takes {methods or 'no method'}",
            "method_not_allowed",
        )
    endpoints = ", ".join(api_endpoints(request))
    return f"Invalid URL ({asked}): no such endpoint; omlx serves {endpoints}", "unknown_url"
