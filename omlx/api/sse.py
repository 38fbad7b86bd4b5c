"""Server-sent events framing for streaming responses."""

from __future__ import annotations

import json
from typing import Any

# Streaming responses: never cached, never buffered by a proxy.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"


def sse_data(payload: dict[str, Any]) -> str:
    """One ``data:`` event; compact JSON never contains a raw newline."""
    return "data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def sse_named(name: str, payload: dict[str, Any]) -> str:
    """One named event (Anthropic's and the Responses API's streams)."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n"
