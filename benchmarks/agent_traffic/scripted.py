"""The recorder's scripted model: what to answer, from the request alone.

While the conversation holds fewer tool results than the script's length, call the
agent's shell tool with the next command; then answer in text. Requests without tools
(titles, summaries) get a short text. Deterministic, so a re-run records the same turns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

COMMANDS = ("ls", "cat notes.txt", "wc -l main.py", "head -n 1 main.py")
SHELL_NAMES = ("Bash", "bash", "shell", "exec_command", "shell_command", "local_shell")
FINAL_TEXT = "The project is omlx, a local LLM server for Apple Silicon; notes.txt says so."
SIDE_TEXT = "Listing project files"


@dataclass(frozen=True, slots=True)
class Answer:
    text: str | None = None
    tool_name: str | None = None
    arguments: str | None = None  # JSON text
    call_id: str = ""


def _tools(kind: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Tool name -> JSON schema of its parameters, namespaces flattened."""
    found: dict[str, dict[str, Any]] = {}
    for tool in body.get("tools") or []:
        if kind == "chat":
            fn = tool.get("function") or {}
            found[fn.get("name", "")] = fn.get("parameters") or {}
        elif kind == "anthropic":
            found[tool.get("name", "")] = tool.get("input_schema") or {}
        elif tool.get("type") == "function":
            found[tool.get("name", "")] = tool.get("parameters") or {}
    return found


def _tool_results(kind: str, body: dict[str, Any]) -> int:
    if kind == "chat":
        return sum(1 for m in body.get("messages") or [] if m.get("role") == "tool")
    if kind == "anthropic":
        count = 0
        for message in body.get("messages") or []:
            content = message.get("content")
            if isinstance(content, list):
                count += sum(1 for b in content if b.get("type") == "tool_result")
        return count
    items = body.get("input")
    if not isinstance(items, list):
        return 0
    return sum(1 for i in items if str(i.get("type", "")).endswith("call_output"))


def _arguments(schema: dict[str, Any], command: str) -> dict[str, Any]:
    props = schema.get("properties") or {}
    args: dict[str, Any] = {}
    for name in ("command", "cmd"):
        if name in props:
            wants_list = props[name].get("type") == "array"
            args[name] = ["bash", "-lc", command] if wants_list else command
            break
    if "description" in props:
        args["description"] = f"Run {command}"
    for name in schema.get("required") or []:
        if name not in args and props.get(name, {}).get("type") in ("integer", "number"):
            args[name] = 10000
        elif name not in args and name in ("workdir", "cwd"):
            args[name] = "."
    return args


def answer_for(kind: str, body: dict[str, Any], tool_calls: int) -> Answer:
    tools = _tools(kind, body)
    shell = next((name for name in SHELL_NAMES if name in tools), None)
    if shell is None:
        return Answer(text=SIDE_TEXT if not tools else FINAL_TEXT)
    done = _tool_results(kind, body)
    if done >= tool_calls:
        return Answer(text=FINAL_TEXT)
    if done == 1 and "ToolSearch" in tools:
        # Claude Code loads a deferred tool mid-session, as a model does when it needs one.
        arguments = json.dumps({"query": "select:NotebookEdit"})
        return Answer(tool_name="ToolSearch", arguments=arguments, call_id=f"call_{done + 1:04d}")
    command = COMMANDS[done % len(COMMANDS)]
    arguments = json.dumps(_arguments(tools[shell], command))
    return Answer(tool_name=shell, arguments=arguments, call_id=f"call_{done + 1:04d}")
