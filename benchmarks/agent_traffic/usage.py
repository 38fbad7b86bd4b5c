"""Reading a streamed answer of any of the three APIs: when the first token came, and
the usage the server reported (prompt, cached and output tokens)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Events that carry generated output (text, a tool call's arguments, reasoning).
FIRST_OUTPUT = {
    "content_block_delta",
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.reasoning_text.delta",
}


@dataclass(slots=True)
class Seen:
    ttft_s: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None


def _chat_usage(seen: Seen, usage: dict[str, Any]) -> None:
    seen.prompt_tokens = usage.get("prompt_tokens")
    seen.output_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    seen.cached_tokens = details.get("cached_tokens")


def _anthropic_usage(seen: Seen, usage: dict[str, Any]) -> None:
    if "input_tokens" in usage:
        cached = usage.get("cache_read_input_tokens") or 0
        written = usage.get("cache_creation_input_tokens") or 0
        seen.prompt_tokens = usage["input_tokens"] + cached + written
        seen.cached_tokens = cached
    if "output_tokens" in usage:
        seen.output_tokens = usage["output_tokens"]


def _responses_usage(seen: Seen, usage: dict[str, Any]) -> None:
    seen.prompt_tokens = usage.get("input_tokens")
    seen.output_tokens = usage.get("output_tokens")
    seen.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")


def _has_output(kind: str, event: dict[str, Any]) -> bool:
    if kind == "chat":
        choices = event.get("choices") or [{}]
        delta = choices[0].get("delta") or {}
        return bool(
            delta.get("content")
            or delta.get("tool_calls")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
        )
    return event.get("type") in FIRST_OUTPUT


def read_stream(kind: str, lines: Iterable[str], started: float) -> Seen:
    seen = Seen()
    for line in lines:
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        event = json.loads(line[5:])
        if not seen.ttft_s and _has_output(kind, event):
            seen.ttft_s = time.perf_counter() - started
        if kind == "chat" and event.get("usage"):
            _chat_usage(seen, event["usage"])
        elif kind == "anthropic":
            message = event.get("message") or {}
            _anthropic_usage(seen, message.get("usage") or event.get("usage") or {})
        elif event.get("type") in ("response.completed", "response.incomplete"):
            _responses_usage(seen, event["response"].get("usage") or {})
    if not seen.ttft_s:  # no output at all: the whole answer's time
        seen.ttft_s = time.perf_counter() - started
    return seen
