"""Tools a vendor's own servers run (web search, code execution...), as agents declare
them alongside their function tools.

A local model cannot run them, and the agent does not expect us to: Codex declares
``web_search`` on every turn. So they are left out of the prompt, named in the
``X-Omlx-Tools-Dropped`` header and the log, and the turn goes on. A ``tool_choice``
that names one stays a 400 (each API's tool-choice check refuses it). Types we do not
know stay a 400 too: they may be tools the client expects the model to call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)

DROPPED_HEADER = "X-Omlx-Tools-Dropped"

# OpenAI Responses hosted tools (dated variants such as web_search_2025_08_26 too).
_RESPONSES_HOSTED = (
    "web_search",
    "file_search",
    "computer_use",
    "computer",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "tool_search",
)
# Anthropic server tools; their types carry a version date (web_search_20250305).
_ANTHROPIC_SERVER = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")


def is_responses_hosted(kind: object) -> bool:
    return isinstance(kind, str) and any(
        kind == name or kind.startswith(name + "_") for name in _RESPONSES_HOSTED
    )


def is_anthropic_server_tool(kind: object) -> bool:
    return isinstance(kind, str) and kind.startswith(_ANTHROPIC_SERVER)


def dropped_header(dropped: Sequence[str]) -> dict[str, str]:
    """The header naming the tools left out (empty when none were)."""
    if not dropped:
        return {}
    listed = "; ".join(dict.fromkeys(dropped))  # each type once, in request order
    log.warning("tools left out of the prompt (run by a vendor's servers): %s", listed)
    return {DROPPED_HEADER: listed}
