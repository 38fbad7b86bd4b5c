"""Tool calls a model wrote slightly wrong, recovered where only one reading exists.

Small local models often get the markup almost right: a stray closing brace after
the JSON, two calls in one block, or the call's JSON with no ``<tool_call>`` wrapper
at all (sometimes in a code fence, sometimes with only the end marker). oMLX and
Rapid-MLX recover these; so do we, but only when nothing else could be meant: the
leftovers are closing punctuation, and a bare call must be the whole answer and
name a tool the request declared. Anything else stays text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from typing import Any

# What may follow the last JSON value of a call: whitespace and closing punctuation.
_LEFTOVER = re.compile(r"[\s}\]),;]*")
_FENCE = re.compile(r"^```[a-zA-Z]*\s*(.*?)\s*```$", re.DOTALL)
_DECODER = json.JSONDecoder()


def json_values(text: str) -> list[Any]:
    """The JSON values ``text`` holds one after another (whitespace or commas between,
    closing punctuation after); raises ValueError when anything else is there."""
    values, at = [], 0
    text = text.strip()
    while at < len(text):
        value, at = _DECODER.raw_decode(text, at)
        values.append(value)
        gap = _LEFTOVER.match(text, at)
        end = gap.end() if gap else at
        if end == len(text):
            break
        if text[at:end].strip(" \t\r\n,"):
            raise ValueError(f"text after the tool call's JSON: {text[at:end]!r}")
        at = end
    if not values:
        raise ValueError("no JSON in the tool call")
    return values


def bare_calls(
    text: str,
    names: Collection[str],
    markers: tuple[str, str],
    to_call: Callable[[Any], tuple[str, dict[str, Any]]],
) -> list[tuple[str, dict[str, Any]]] | None:
    """``text`` (a whole answer) as tool calls when it is nothing but calls of the
    declared ``names`` (fenced or not, a lone start or end marker around it); else None."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    start, end = markers
    body = body.removeprefix(start).strip()
    if end:
        body = body.removesuffix(end).strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        values = json_values(body)
        flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
        calls = [to_call(value) for value in flat]
    except (ValueError, TypeError):
        return None
    if not calls or any(name not in names for name, _ in calls):
        return None
    return calls
