"""Whether a model's context window can hold what a coding agent sends.

Agents open with long system prompts and tool lists (Claude Code ~20k tokens), so a
model with a small window refuses every turn ("the prompt is N tokens but the context
window is M"), however good it is. ``omlx launch`` and the Connect page warn before
that happens, from each agent's first request as recorded with the real tools
(``omlx/data/agent_first_requests.json``, written by
``benchmarks/agent_traffic/first_requests.py``). Pure: no MLX, no HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

# Room a window needs beyond the first request: the answers and tool results of the
# next turns, before the agent's own compaction (told the window by ``omlx launch``)
# shortens the conversation.
TURNS_FACTOR = 2
DISPLAY_NAMES = {"claude": "Claude Code", "codex": "Codex", "opencode": "opencode"}


@dataclass(frozen=True, slots=True)
class FirstRequest:
    """One agent's first request as recorded: its tool version and prompt tokens."""

    version: str
    tokens: int  # the most any recorded tokenizer counted


@cache
def recorded() -> dict[str, FirstRequest]:
    """The packaged recordings (empty when the data file is missing)."""
    try:
        text = (resources.files("omlx") / "data" / "agent_first_requests.json").read_text()
    except OSError:
        return {}
    return parse_recorded(json.loads(text))


def parse_recorded(data: Mapping[str, Any]) -> dict[str, FirstRequest]:
    found = {}
    for tool, entry in (data.get("tools") or {}).items():
        counts = [n for n in (entry.get("tokens") or {}).values() if isinstance(n, int)]
        if counts:
            found[tool] = FirstRequest(str(entry.get("version", "")), max(counts))
    return found


def context_warning(
    tool: str,
    model: str,
    window: int | None,
    first_requests: Mapping[str, FirstRequest] | None = None,
) -> str | None:
    """What to tell the user when ``model``'s window is too small for ``tool`` (None:
    it is big enough, or one of the two is unknown)."""
    first = (recorded() if first_requests is None else first_requests).get(tool)
    if first is None or window is None:
        return None
    wanted = _round_up(first.tokens * TURNS_FACTOR, 8192)
    if window >= wanted:
        return None
    name = DISPLAY_NAMES.get(tool, tool)
    measured = f"{name}'s first request alone is about {first.tokens:,} tokens"
    if first.version:
        measured += f" (measured with {name} {first.version})"
    outcome = (
        "every request will be refused"
        if window <= first.tokens
        else "it will be full after a few turns"
    )
    return (
        f"{measured}, and '{model}' has a context window of {window:,} tokens: {outcome}. "
        f"Pick a model with a context of at least {wanted // 1024}k, or raise this model's "
        "max_context_window (admin panel, Models, its settings) if the model supports more."
    )


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step
