"""Recorded Anthropic and Responses requests as Chat Completions requests, for servers
that speak only that API (mlx_lm.server): the same conversation, tools and order."""

from __future__ import annotations

import json
from typing import Any

from omlx.api.prompts import with_hermes_tools

HOSTED = ("web_search", "file_search", "computer_use", "code_interpreter", "image_generation")


def flat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses tools as a server that runs none of the hosted ones sees them: namespaces
    flattened into their function tools, hosted tools left out (issue 39)."""
    flat = []
    for tool in tools:
        if tool.get("type") == "namespace":
            flat += [t for t in tool.get("tools", []) if t.get("type") == "function"]
        elif tool.get("type") not in HOSTED:
            flat.append(tool)
    return flat


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") for p in content or [] if isinstance(p, dict)]
    return "".join(parts)


def _function(name: str, description: str | None, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description or "", "parameters": schema},
    }


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """Consecutive calls belong to one assistant message."""
    last = messages[-1] if messages else None
    if last and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _anthropic_message(message: dict[str, Any], out: list[dict[str, Any]]) -> None:
    content = message["content"]
    if isinstance(content, str):
        out.append({"role": message["role"], "content": content})
        return
    texts = [b["text"] for b in content if b.get("type") == "text"]
    if message["role"] == "assistant":
        if texts:
            out.append({"role": "assistant", "content": "".join(texts)})
        for block in content:
            if block.get("type") == "tool_use":
                _add_call(out, _call(block["id"], block["name"], json.dumps(block["input"])))
        return
    for block in content:
        if block.get("type") == "tool_result":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": _text(block.get("content")),
                }
            )
    if texts:
        out.append({"role": message["role"], "content": "".join(texts)})


def from_anthropic(body: dict[str, Any]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if body.get("system"):
        messages.append({"role": "system", "content": _text(body["system"])})
    for message in body["messages"]:
        _anthropic_message(message, messages)
    tools = [
        _function(t["name"], t.get("description"), t.get("input_schema") or {})
        for t in body.get("tools") or []
        if "input_schema" in t
    ]
    return {"model": body["model"], "messages": messages, "tools": tools}


def from_responses(body: dict[str, Any]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    for item in body["input"]:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item["content"])})
        elif kind == "function_call":
            _add_call(messages, _call(item["call_id"], item["name"], item["arguments"]))
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])}
            )
    tools = [
        _function(t["name"], t.get("description"), t.get("parameters") or {})
        for t in flat_tools(body.get("tools") or [])
    ]
    return {"model": body["model"], "messages": messages, "tools": tools}


def tools_in_system(body: dict[str, Any]) -> dict[str, Any]:
    """Tools written into the system message and past calls into the assistant text,
    the way omlx renders them for a chat template without tools (SmolLM2's). The calls
    stay as ``tool_calls`` too (that template ignores them), for servers that check each
    tool result answers a call."""
    messages = with_hermes_tools(body["messages"], body["tools"])
    offset = len(messages) - len(body["messages"])  # a system message put first
    for original, written in zip(body["messages"], messages[offset:], strict=True):
        if original.get("tool_calls"):
            written["tool_calls"] = original["tool_calls"]
    return {k: v for k, v in body.items() if k != "tools"} | {"messages": messages}


def request_as_chat(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """A recorded request's body as a Chat Completions body with the tools in the system
    message: the prompt text every server computes in the replay's converted mode."""
    if kind == "anthropic":
        body = from_anthropic(body)
    elif kind == "responses":
        body = from_responses(body)
    return tools_in_system(body) if body.get("tools") else body
