"""Request bodies are checked before any route parses them: over
``server.max_body_bytes`` -> 413; not UTF-8, nested too deeply for the JSON
parser, or holding a lone UTF-16 surrogate (``"\\ud800"``, which no tokenizer or
encoder accepts) -> 400. Each once, here, rather than in every route.

A pure ASGI middleware: a ``Content-Length`` over the limit is refused without
reading anything; otherwise the body is read up to the limit (so a chunked body
without a length is counted too) and replayed to the app. Routes read the whole
JSON body before they do anything, so buffering it here costs nothing extra.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omlx.api.errors import omlx_error_response
from omlx.errors import InvalidRequestError, RequestTooLargeError
from omlx.sizes import format_bytes

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Bodies that are not text, so not JSON either.
_BINARY_TYPES = (b"multipart/", b"application/octet-stream", b"image/", b"audio/", b"video/")
# Below this many brackets the JSON parser cannot run out of recursion depth.
_MAX_SAFE_BRACKETS = 500
# A \uD800-\uDFFF escape (odd run of backslashes: the backslash itself is not escaped).
_SURROGATE_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BodyGuardMiddleware:
    """``limit_fn`` is read per request, so a changed setting applies at once."""

    def __init__(self, app: ASGIApp, limit_fn: Callable[[], int]):
        self.app = app
        self._limit_fn = limit_fn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = self._limit_fn()
        try:
            declared = _header(scope, b"content-length")
            if declared is not None and _length(declared) > limit:
                raise _too_large(limit, f"Content-Length is {_length(declared)} bytes")
            body, gone = await _read_body(receive, limit)
            if not (_header(scope, b"content-type") or b"").lower().startswith(_BINARY_TYPES):
                check_json_text(body)
        except InvalidRequestError as exc:
            await omlx_error_response(Request(scope), exc)(scope, receive, send)
            return
        if gone:  # the client went away while sending
            return
        await self.app(scope, _replay(body, receive), send)


def check_json_text(body: bytes) -> None:
    """InvalidRequestError for text no JSON route could use (see the module doc)."""
    try:
        body.decode("utf-8")  # strict: CESU-8 surrogates are refused too
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"request body is not valid UTF-8 (send JSON as UTF-8): {exc}"
        ) from None
    deep = body.count(b"[") + body.count(b"{") > _MAX_SAFE_BRACKETS
    if not deep and not _SURROGATE_ESCAPE.search(body):
        return
    try:
        value = json.loads(body)
    except RecursionError:
        raise InvalidRequestError("request body is not valid JSON: nested too deeply") from None
    except ValueError:
        return  # not JSON at all: the route says so in its own words
    if _has_lone_surrogate(value):
        raise InvalidRequestError(
            "request body has a lone UTF-16 surrogate escape (e.g. \\ud800), which is not "
            "valid Unicode text"
        )


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:  # iterative: the value may be nested as deep as the parser allows
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


def _too_large(limit: int, what: str) -> RequestTooLargeError:
    return RequestTooLargeError(
        f"request body too large: {what}, the limit is {limit} bytes ({format_bytes(limit)}); "
        "send less, or raise server.max_body_bytes (--max-body-bytes)"
    )


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _length(value: bytes) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidRequestError("Content-Length is not a number") from None


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """(the whole body, whether the client left before its end); RequestTooLargeError
    as soon as more than ``limit`` bytes came."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"", True
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, f"more than {limit} bytes were sent")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body first, then the real channel (disconnect detection)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
