"""The one place where errors become HTTP responses (OpenAI envelope; Anthropic's
on the Anthropic routes, Ollama's on the Ollama routes)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omlx.api.route_errors import is_routing_error, routing_error
from omlx.errors import OmlxError

log = logging.getLogger(__name__)

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "overloaded_error",
}


# Paths answered in the Anthropic Messages API error shape.
ANTHROPIC_PATH_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
}


# Paths answered in Ollama's error shape: {"error": "<message>"}.
OLLAMA_PATH_PREFIX = "/api/"


def anthropic_error_body(message: str, error_type: str, http_status: int) -> dict[str, Any]:
    """``{"type": "error", "error": {...}}`` with our error type mapped to Anthropic's."""
    if http_status == 413:
        error_type = "request_too_large"
    elif error_type not in _ANTHROPIC_TYPES:
        if http_status == 429:
            error_type = "rate_limit_error"
        elif http_status in (503, 529):
            error_type = "overloaded_error"
        else:
            error_type = "api_error" if http_status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": error_type, "message": message}}


def _error_response(
    request: Request,
    body: dict[str, Any],
    status: int,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    path = request.url.path
    # /v1/models answers the anthropic SDK (it sends anthropic-version) in its shape.
    anthropic_models = path.startswith("/v1/models") and "anthropic-version" in request.headers
    if path.startswith(ANTHROPIC_PATH_PREFIX) or anthropic_models:
        body = anthropic_error_body(body["error"]["message"], body["error"]["type"], status)
    elif request.url.path.startswith(OLLAMA_PATH_PREFIX):
        body = {"error": body["error"]["message"]}
    return JSONResponse(body, status_code=status, headers=headers)


def omlx_error_response(request: Request, exc: OmlxError) -> JSONResponse:
    """The response for ``exc`` (for middleware, which runs outside the handlers)."""
    return _error_response(request, omlx_error_body(exc), exc.http_status, exc.headers())


def is_json_type(content_type: str) -> bool:
    """``application/json`` or ``application/<x>+json``, any parameters."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _unparsed_body(request: Request, exc: RequestValidationError) -> bool:
    """FastAPI leaves a body with a non-JSON content type unparsed, then fails it."""
    if is_json_type(request.headers.get("content-type", "")):
        return False
    return any(tuple(err.get("loc", ()))[:1] == ("body",) for err in exc.errors())


def error_body(
    message: str, error_type: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def omlx_error_body(exc: OmlxError) -> dict[str, Any]:
    body = error_body(exc.message, exc.error_type, exc.code, exc.param)
    body["error"].update(exc.extra_fields())
    return body


# Union members pydantic adds to an error's location ("content.str"): not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    parts = [p for p in parts if p not in _TYPE_TAGS and "[" not in p]
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


def describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence per problem, naming the field; plus the first field."""
    problems, first = [], None
    for err in exc.errors():
        param = _loc_to_param(tuple(err.get("loc", ())))
        if err.get("type") == "json_invalid":
            problems.append("request body is not valid JSON")
            continue
        if err.get("type") == "missing":
            problems.append(
                f"'{param}' is required" if param else "a JSON request body is required"
            )
        elif param and problems and problems[-1].startswith(f"'{param}': "):
            problems[-1] += f", or {err.get('msg')}"  # one union field: the members' errors
        elif param:
            problems.append(f"'{param}': {err.get('msg')}")
        else:
            problems.append(f"request body: {err.get('msg')}")
        first = first or param or None
    return "; ".join(problems) or "invalid request", first


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OmlxError)
    async def _omlx(request: Request, exc: OmlxError) -> JSONResponse:
        if exc.http_status >= 500 and exc.http_status != 501:  # 501: the client asked
            level = logging.WARNING if exc.http_status == 503 else logging.ERROR
            log.log(level, "%s %s failed: %s", request.method, request.url.path, exc.message)
        return _error_response(request, omlx_error_body(exc), exc.http_status, exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if _unparsed_body(request, exc):
            got = request.headers.get("content-type") or "none"
            message = f"send the body as JSON with 'Content-Type: application/json' (got {got!r})"
            body = error_body(message, "invalid_request_error", "unsupported_media_type")
            return _error_response(request, body, 415)
        message, param = describe_validation(exc)
        body = error_body(message, "invalid_request_error", "invalid_request", param)
        return _error_response(request, body, 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = _STATUS_TYPES.get(exc.status_code, "server_error")
        body = error_body(str(exc.detail), error_type, None)
        if is_routing_error(request, exc.status_code, exc.detail):
            allow = (exc.headers or {}).get("Allow")
            message, code = routing_error(request, exc.status_code, allow)
            body = error_body(message, error_type, code)
        return _error_response(request, body, exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        body = error_body(f"internal error: {type(exc).__name__}", "server_error", "internal_error")
        return _error_response(request, body, 500)
