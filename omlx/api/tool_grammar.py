"""Request fields that constrain tool calls: ``tool_choice`` (OpenAI and Anthropic)
and tools marked ``strict``, turned into a ``ToolConstraint`` and, once the
model is known, into a grammar in that model's tool-call syntax."""

from __future__ import annotations

import dataclasses
from typing import Any

from omlx.api.output_parser import HERMES_FORMATS, think_markers, tool_format
from omlx.errors import InvalidRequestError
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import (
    HERMES,
    CallSyntax,
    Mode,
    ToolConstraint,
    ToolSchema,
    check_schemas,
    tool_grammar,
)

# "hermes" is output_parser's default for models that name no format.
_SYNTAXES: dict[str, CallSyntax] = {name: HERMES for name in HERMES_FORMATS}
OPENAI_SCHEMA_PARAM = "tools[{i}].function.parameters"


def openai_tool_constraint(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: Any = None
) -> ToolConstraint | None:
    """The constraint of a chat completion's ``tools`` / ``tool_choice`` /
    ``parallel_tool_calls``; None when calls are free (no strict tool, no forcing)."""
    choice = "auto" if tool_choice is None else tool_choice
    parallel_calls = parallel is not False
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        mode: Mode = "auto" if choice == "auto" else "required"
        param = "tool_choice" if tool_choice is not None else "tools"
        return tool_constraint(tools, mode, parallel=parallel_calls, param=param)
    if isinstance(choice, dict) and choice.get("type") == "function":
        # Chat Completions nests the name; the Responses API puts it on the choice.
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        param = "tool_choice.function.name" if isinstance(function, dict) else "tool_choice.name"
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("tool_choice must name the function to call", param=param)
        return tool_constraint(tools, "forced", names=[name], param=param)
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed_tools(tools, choice, parallel_calls)
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required', "
        '{"type": "function", "function": {"name": ...}} or {"type": "allowed_tools", ...}',
        param="tool_choice",
    )


def _allowed_tools(
    tools: list[dict[str, Any]] | None, choice: dict[str, Any], parallel: bool
) -> ToolConstraint | None:
    allowed = choice.get("allowed_tools")
    param = "tool_choice.allowed_tools"
    if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required"):
        raise InvalidRequestError(
            "allowed_tools needs a mode ('auto' or 'required') and a list of tools",
            param=f"{param}.mode",
        )
    refs = allowed.get("tools")
    if not isinstance(refs, list) or not refs:
        raise InvalidRequestError("allowed_tools.tools must list tools", param=f"{param}.tools")
    names = [name for name in map(_function_name, refs) if name is not None]
    if len(names) != len(refs):
        raise InvalidRequestError(
            'each allowed tool must be {"type": "function", "function": {"name": ...}}',
            param=f"{param}.tools",
        )
    return tool_constraint(
        tools, allowed["mode"], names=names, parallel=parallel, param=f"{param}.tools"
    )


def tool_constraint(
    tools: list[dict[str, Any]] | None,
    mode: Mode,
    *,
    names: list[str] | None = None,
    parallel: bool = True,
    param: str = "tool_choice",
    schema_param: str = OPENAI_SCHEMA_PARAM,
) -> ToolConstraint | None:
    """The constraint over OpenAI-shaped function ``tools`` (only ``names``, when
    given); None in ``auto`` mode when no tool is strict."""
    # Only function tools have an argument schema (OpenAI "custom" tools take free text).
    schemas = [
        _tool_schema(tool, i, schema_param)
        for i, tool in enumerate(tools or [])
        if not isinstance(tool, dict) or tool.get("type", "function") == "function"
    ]
    if names is not None:
        known = {s.name for s in schemas}
        missing = [n for n in names if n not in known]
        if missing:
            raise InvalidRequestError(
                f"tool_choice names '{missing[0]}', which is not in 'tools' "
                f"(tools: {', '.join(sorted(known)) or 'none'})",
                param=param,
            )
        schemas = [s for s in schemas if s.name in names]
    if mode == "auto" and not any(s.strict for s in schemas):
        return None
    if not schemas:
        raise InvalidRequestError(
            f"tool_choice '{mode}' needs at least one tool in 'tools'", param=param
        )
    constraint = ToolConstraint(mode, tuple(schemas), parallel, param)
    return dataclasses.replace(constraint, unenforced=check_schemas(constraint))


def _tool_schema(tool: Any, i: int, schema_param: str) -> ToolSchema:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict):
        function = {}
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}',
            param=f"tools[{i}].function.name",
        )
    parameters = function.get("parameters")
    param = schema_param.format(i=i)
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    return ToolSchema.create(name, parameters, strict=function.get("strict") is True, param=param)


def _function_name(ref: Any) -> str | None:
    if not isinstance(ref, dict) or ref.get("type") != "function":
        return None
    function = ref.get("function")
    name = function.get("name") if isinstance(function, dict) else ref.get("name")
    return name if isinstance(name, str) and name else None


def combined(
    output: GrammarSpec | None, tools: ToolConstraint | None
) -> GrammarSpec | ToolConstraint | None:
    """The one constraint of a request; both an output format and constrained tool
    calls cannot be honoured by one grammar yet."""
    if output is not None and tools is not None:
        raise InvalidRequestError(
            f"{output.param} cannot be combined with a forced tool choice or strict tools "
            "(one grammar constrains the output); drop one of them",
            param=tools.param,
        )
    return output or tools


def tool_grammar_spec(tokenizer: Any, constraint: ToolConstraint) -> GrammarSpec:
    """The grammar of ``constraint`` in the model's tool-call syntax. Blocking."""
    fmt = tool_format(tokenizer)
    syntax = _SYNTAXES.get(fmt)
    if syntax is None:
        asked = (
            "strict tools"
            if constraint.mode == "auto"
            else f"tool_choice '{constraint.mode}'"
            if constraint.mode == "required"
            else "a named tool_choice"
        )
        raise InvalidRequestError(
            f"{asked} needs a grammar for this model's tool-call format '{fmt}', which is "
            f"not supported (supported: {', '.join(sorted(_SYNTAXES))}); "
            "use tool_choice 'auto' without strict tools",
            param=constraint.param,
        )
    think = think_markers(tokenizer) if getattr(tokenizer, "has_thinking", False) else None
    return tool_grammar(constraint, syntax, think)
