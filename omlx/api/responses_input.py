"""Responses API request parts in the shapes the chat pipeline takes: input items
to chat messages, function and namespace tools to Chat Completions tools (hosted
tools left out), ``tool_choice`` to a ToolConstraint, ``text.format`` to a
GrammarSpec, ``reasoning`` to template variables. Items are normalised (ids,
statuses) so they can be stored and listed."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from omlx.api.hosted_tools import is_responses_hosted
from omlx.api.images import ImageSink, from_data_url
from omlx.api.responses_schemas import ReasoningConfig, TextConfig
from omlx.api.tool_grammar import tool_constraint
from omlx.errors import InvalidRequestError
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import Mode, ToolConstraint

Item = dict[str, Any]
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = ("user", "assistant", "system", "developer")
_SCHEMA_PARAM = "tools[{i}].parameters"


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(value: str | list[dict[str, Any]]) -> list[Item]:
    """The request's ``input`` as normalised items (a string is one user message)."""
    if isinstance(value, str):
        return [_message("user", value)]
    return [_item(raw, f"input[{i}]") for i, raw in enumerate(value)]


def _message(role: str, text: str, item_id: str | None = None) -> Item:
    part_type = "output_text" if role == "assistant" else "input_text"
    part: dict[str, Any] = {"type": part_type, "text": text}
    if role == "assistant":
        part["annotations"] = []
    return {
        "id": item_id or new_item_id("msg"),
        "type": "message",
        "role": role,
        "content": [part],
        "status": "completed",
    }


def _item(raw: dict[str, Any], where: str) -> Item:
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "message":
        return _message_item(raw, where)
    if kind == "function_call":
        fields = {k: _string(raw, k, where) for k in ("call_id", "name", "arguments")}
        if raw.get("namespace") is not None:
            fields["namespace"] = _string(raw, "namespace", where)
        return {"id": _id(raw, "fc"), "type": kind, **fields, "status": "completed"}
    if kind == "function_call_output":
        call_id = _string(raw, "call_id", where)
        output = _text_of(raw.get("output"), f"{where}.output")
        return {
            "id": _id(raw, "fco"),
            "type": kind,
            "call_id": call_id,
            "output": output,
            "status": "completed",
        }
    if kind == "reasoning":
        # Kept in the conversation's record; chat templates drop past reasoning anyway.
        return {
            "id": _id(raw, "rs"),
            "type": kind,
            "summary": raw.get("summary") or [],
            "content": raw.get("content") or [],
        }
    raise InvalidRequestError(
        f"{where}: item type '{kind}' is not supported; send message, function_call, "
        "function_call_output or reasoning items",
        param=f"{where}.type",
    )


def _message_item(raw: dict[str, Any], where: str) -> Item:
    role = raw.get("role")
    if role not in _ROLES:
        raise InvalidRequestError(
            f"{where}.role must be one of {', '.join(_ROLES)} (got {role!r})",
            param=f"{where}.role",
        )
    content = raw.get("content")
    item_id = raw.get("id") if isinstance(raw.get("id"), str) else None
    if isinstance(content, list) and any(_is_image(p) for p in content):
        return _message_with_images(role, content, f"{where}.content", item_id)
    text = _text_of(content, f"{where}.content")
    return _message(role, text, item_id)


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "input_image"


def _message_with_images(role: str, content: list[Any], where: str, item_id: str | None) -> Item:
    """A message whose parts include ``input_image``s (data URLs, checked now): its
    parts are kept in order, text parts normalised."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if _is_image(part):
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequestError(
                    f"{where}[{j}]: input_image needs image_url (a data URL); file_id is not "
                    "supported",
                    param=f"{where}[{j}].image_url",
                )
            from_data_url(url, f"{where}[{j}]")
            parts.append({"type": "input_image", "image_url": url, "detail": "auto"})
        else:
            parts.append({"type": "input_text", "text": _text_of([part], where)})
    item = _message(role, "", item_id)
    item["content"] = parts
    return item


def _id(raw: dict[str, Any], prefix: str) -> str:
    given = raw.get("id")
    return given if isinstance(given, str) and given else new_item_id(prefix)


def _string(raw: dict[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _content_text(content: Any, where: str, images: ImageSink | None) -> str:
    """A message's text, its images as the sink's markers in their places."""
    if images is None or not isinstance(content, list) or not any(map(_is_image, content)):
        return _text_of(content, where)
    out = []
    for j, part in enumerate(content):
        if _is_image(part):
            out.append(images.add(from_data_url(part["image_url"], f"{where}[{j}]")))
        else:
            out.append(_text_of([part], where))
    return "".join(out)


def _text_of(content: Any, where: str) -> str:
    """A string, or the text of a list of text parts; other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise InvalidRequestError(
                f"{where}[{j}]: content type '{kind}' is not supported; send text parts only "
                "(input_text, output_text)",
                param=f"{where}[{j}].type",
            )
        texts.append(str(part.get("text") or part.get("refusal") or ""))
    return "".join(texts)


def chat_messages(
    instructions: str | None,
    items: list[Item],
    images: ImageSink | None = None,
    names: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Chat Completions messages for the template; function calls join the assistant
    message before them, outputs become role "tool" messages. ``images``: where
    ``input_image`` parts go; ``names``: item id -> how errors name it (``input[i]``)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for k, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            where = f"{(names or {}).get(item['id'], f'items[{k}]')}.content"
            messages.append(
                {"role": role, "content": _content_text(item["content"], where, images)}
            )
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {
                    "name": flat_name(item.get("namespace"), item["name"]),
                    "arguments": item["arguments"],
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages


NAMESPACE_SEPARATOR = "__"  # a namespaced tool's flat name: <namespace>__<name>


@dataclass(frozen=True, slots=True)
class DeclaredTools:
    """A request's tools as the template takes them: function tools, namespaces
    flattened into theirs, hosted tools left out."""

    chat: list[dict[str, Any]] | None  # Chat Completions tools (None: none to offer)
    # Flat name -> (namespace, name), to name a call as the client declared it.
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()  # hosted tool types left out of the prompt


def chat_tools(tools: list[dict[str, Any]] | None) -> DeclaredTools:
    """Responses tools as Chat Completions tools: ``namespace`` tools give their
    function tools, named ``<namespace>__<name>``; hosted tools are dropped."""
    chat: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}
    dropped: list[str] = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind == "namespace":
            for function, inner_name in _namespace(tool, i):
                chat.append(function)
                namespaced[function["function"]["name"]] = (tool["name"], inner_name)
        elif is_responses_hosted(kind):
            dropped.append(str(kind))
        else:
            chat.append(_chat_tool(tool, f"tools[{i}]"))
    _check_unique(chat)
    return DeclaredTools(chat or None, namespaced, tuple(dropped))


def flat_name(namespace: str | None, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def _namespace(tool: dict[str, Any], i: int) -> list[tuple[dict[str, Any], str]]:
    """The namespace's function tools, flat-named, each with its own name."""
    where = f"tools[{i}]"
    name, inner = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name or not isinstance(inner, list) or not inner:
        raise InvalidRequestError(
            f"{where}: a namespace tool needs a 'name' and a non-empty 'tools' list",
            param=f"{where}.tools",
        )
    group = []
    for j, raw in enumerate(inner):
        function = _chat_tool(raw, f"{where}.tools[{j}]")
        own = function["function"]["name"]
        function["function"]["name"] = flat_name(name, own)
        if isinstance(tool.get("description"), str):
            # The namespace's description says what its tools are for.
            description = function["function"].get("description", "")
            function["function"]["description"] = f"{tool['description']} {description}".strip()
        group.append((function, own))
    return group


def _check_unique(tools: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for tool in tools:
        name = tool["function"]["name"]
        if name in seen:
            raise InvalidRequestError(
                f"two tools are named '{name}' (a namespaced tool is named "
                f"<namespace>{NAMESPACE_SEPARATOR}<name>); give each tool its own name",
                param="tools",
            )
        seen.add(name)


def _chat_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise InvalidRequestError(
            f"{where}: tool type '{kind}' is not supported; send 'function' or 'namespace' "
            "tools (hosted tools such as web_search are left out of the prompt)",
            param=f"{where}.type",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.name is required", param=f"{where}.name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(
            f"{where}.parameters must be a JSON schema object", param=f"{where}.parameters"
        )
    function: dict[str, Any] = {
        "name": name,
        "parameters": parameters or {"type": "object", "properties": {}},
        "strict": tool.get("strict") is True,
    }
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def tool_rule(
    tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool | None
) -> ToolConstraint | None:
    """The constraint of ``tool_choice`` over the (Chat-shaped) ``tools``."""
    many = parallel is not False
    if choice == "none":
        return None
    if choice is None or choice in ("auto", "required"):
        mode: Mode = "required" if choice == "required" else "auto"
        param = "tool_choice" if choice else "tools"
        return tool_constraint(tools, mode, parallel=many, param=param, schema_param=_SCHEMA_PARAM)
    assert isinstance(choice, dict)
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("tool_choice.name is required", param="tool_choice.name")
        return tool_constraint(
            tools, "forced", names=[name], param="tool_choice.name", schema_param=_SCHEMA_PARAM
        )
    if kind == "allowed_tools":
        return _allowed(tools, choice, many)
    raise InvalidRequestError(
        f"tool_choice type '{kind}' is not supported; use 'auto', 'none', 'required', "
        '{"type": "function", "name": ...} or {"type": "allowed_tools", ...}',
        param="tool_choice.type",
    )


def _allowed(
    tools: list[dict[str, Any]] | None, choice: dict[str, Any], parallel: bool
) -> ToolConstraint | None:
    mode, refs = choice.get("mode"), choice.get("tools")
    if mode not in ("auto", "required"):
        raise InvalidRequestError(
            "tool_choice.mode must be 'auto' or 'required'", param="tool_choice.mode"
        )
    refs = refs if isinstance(refs, list) else []
    names = [
        r["name"]
        for r in refs
        if isinstance(r, dict) and r.get("type") == "function" and isinstance(r.get("name"), str)
    ]
    if not refs or len(names) != len(refs):
        raise InvalidRequestError(
            'tool_choice.tools must list {"type": "function", "name": ...} entries',
            param="tool_choice.tools",
        )
    return tool_constraint(
        tools,
        mode,
        names=names,
        parallel=parallel,
        param="tool_choice.tools",
        schema_param=_SCHEMA_PARAM,
    )


def one_constraint(
    output: GrammarSpec | None, tools: ToolConstraint | None
) -> GrammarSpec | ToolConstraint | None:
    """One grammar per request: a forced call (required / named) writes no text for
    ``text.format`` to shape, so the call's grammar wins; under "auto" the text format
    wins and strict tools' arguments are parsed but not grammar-enforced. (Agents
    send both: strict tools and an output type.)"""
    if output is None or tools is None:
        return output or tools
    return output if tools.mode == "auto" else tools


def output_spec(text: TextConfig | None) -> GrammarSpec | None:
    """The grammar of ``text.format``: None for free text."""
    fmt = (text.format if text else None) or {}
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", param="text.format")
    if kind != "json_schema":
        raise InvalidRequestError(
            f"text.format.type '{kind}' is not one of text, json_object, json_schema",
            param="text.format.type",
        )
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "text.format.schema must be a JSON schema object", param="text.format.schema"
        )
    return GrammarSpec.json_schema(
        schema, strict=fmt.get("strict") is True, param="text.format.schema"
    )


def reasoning_template_vars(reasoning: ReasoningConfig | None) -> dict[str, Any] | None:
    """Template variables for ``reasoning.effort``: gpt-oss style templates read
    ``reasoning_effort``, Qwen3 style ones ``enable_thinking``."""
    effort = reasoning.effort if reasoning else None
    if effort is None:
        return None
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}
