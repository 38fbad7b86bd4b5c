"""Anthropic deferred tools (tool search): declared with ``defer_loading: true``, they
stay out of the prompt's tool list until a ``tool_reference`` block in a tool result
loads them, and the tool's definition is written there, where it was loaded.

Claude Code declares most tools this way and loads one with its ToolSearch tool; when
it does, the next request lists the loaded tool among the others, in alphabetical
order. Written into the top tool list, that insertion changed the prompt right after
the system prompt, so every later token was computed again (the prefix cache missed
the whole conversation); written where it was loaded, the prompt only grows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from omlx.api.anthropic_schemas import AnthropicTool
from omlx.errors import InvalidRequestError


def is_deferred(tool: AnthropicTool) -> bool:
    return (tool.model_extra or {}).get("defer_loading") is True


def tools_by_name(tools: Sequence[AnthropicTool] | None) -> dict[str, AnthropicTool]:
    return {tool.name: tool for tool in tools or ()}


def loaded_tools_text(
    references: Sequence[tuple[int, dict[str, Any]]], tools: Mapping[str, AnthropicTool], param: str
) -> str:
    """The definitions ``tool_reference`` blocks load, as Claude Code's ToolSearch
    describes its result: one ``<function>`` line each inside a ``<functions>`` block."""
    lines = []
    for k, block in references:
        name = block.get("tool_name")
        tool = tools.get(name) if isinstance(name, str) else None
        if tool is None:
            raise InvalidRequestError(
                f"{param}.content[{k}]: tool_reference names {name!r}, which is not in tools",
                param=f"{param}.content[{k}]",
            )
        definition = {
            "description": tool.description or "",
            "name": tool.name,
            "parameters": tool.input_schema,
        }
        lines.append(f"<function>{json.dumps(definition, ensure_ascii=False)}</function>")
    return "<functions>\n" + "\n".join(lines) + "\n</functions>"
