"""Grammars for tool calls, built from xgrammar structural tags and rendered to EBNF.

Free text is allowed until the model opens a call in its family's syntax
("auto"); inside the call the JSON is fixed to one of the tools' names and that
tool's argument schema. "required" and "forced" allow nothing but calls. The
result is a plain EBNF ``GrammarSpec``, so it goes through the compiler's cache
like any other grammar.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Literal

from omlx.errors import InvalidRequestError
from omlx.grammar import limits
from omlx.grammar.compiler import clean_message, import_xgrammar, json_safe_ebnf
from omlx.grammar.schema_review import refuse_unenforced, review_schema
from omlx.grammar.spec import GrammarSpec

Mode = Literal["auto", "required", "forced"]
# An object with any keys: the arguments of a tool whose schema is not enforced.
_ANY_OBJECT = '{"type": "object"}'
# Whitespace a reasoning model writes between its think block and the first call.
_AFTER_THINK = r"[ \n]{0,4}"


@dataclass(frozen=True, slots=True)
class ToolSchema:
    """One tool as the grammar sees it."""

    name: str
    # The argument schema as JSON text (declared key order kept: models follow it);
    # None when the arguments are any object.
    parameters: str | None
    strict: bool
    # The request field holding the schema, for error messages.
    param: str

    @classmethod
    def create(
        cls, name: str, parameters: dict[str, Any] | None, *, strict: bool, param: str
    ) -> ToolSchema:
        text = json.dumps(parameters, ensure_ascii=False) if parameters is not None else None
        return cls(name, text, strict, param)


@dataclass(frozen=True, slots=True)
class ToolConstraint:
    """What a request asks of tool calls, before the model's call syntax is known.

    ``auto``: text or calls, only ``strict`` tools' schemas enforced. ``required``:
    one or more calls. ``forced``: exactly one call of the single tool in ``tools``.
    Outside ``auto`` every tool's schema is enforced (``strict`` then only decides
    whether keys the schema does not name are refused).
    """

    mode: Mode
    tools: tuple[ToolSchema, ...]
    parallel: bool = True
    # The request field that asked for it, for error messages.
    param: str = "tool_choice"
    # Argument-schema keywords the grammar cannot enforce, with the tool's field.
    unenforced: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """How a model family writes one call: ``prefix`` name ``infix`` arguments ``end``."""

    trigger: str
    prefix: str
    infix: str
    end: str
    separator: str


# Hermes / Qwen: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>. Calls
# follow each other directly: a newline between them would come back as content.
HERMES = CallSyntax(
    trigger="<tool_call>",
    prefix='<tool_call>\n{"name": "',
    infix='", "arguments": ',
    end="}\n</tool_call>",
    separator="",
)


@functools.lru_cache(maxsize=64)
def tool_grammar(
    constraint: ToolConstraint, syntax: CallSyntax, think: tuple[str, str] | None = None
) -> GrammarSpec:
    """The EBNF grammar for ``constraint`` written in ``syntax``.

    ``think`` (a reasoning model's markers) lets a required or forced call be
    preceded by one think block. Raises InvalidRequestError naming the tool's
    schema field when xgrammar rejects a schema. Blocking (xgrammar work): call
    it off the event loop.
    """
    xgr = import_xgrammar()
    tags = [_tag(xgr, tool, syntax, constraint.mode) for tool in constraint.tools]
    fmt = _calls_format(constraint, syntax, tags)
    if think is not None and constraint.mode != "auto":
        fmt = {"type": "sequence", "elements": [_think_block(think), fmt]}
    try:
        grammar = xgr.Grammar.from_structural_tag(
            json.dumps({"type": "structural_tag", "format": fmt})
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequestError(
            f"cannot build the tool-call grammar: {clean_message(exc)}", param=constraint.param
        ) from exc
    return GrammarSpec("grammar", str(grammar), False, constraint.param)


def _calls_format(
    constraint: ToolConstraint, syntax: CallSyntax, tags: list[dict[str, Any]]
) -> dict[str, Any]:
    if constraint.mode == "forced":
        return tags[0]
    if constraint.mode == "required":
        return {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": syntax.separator,
            "at_least_one": True,
            "stop_after_first": not constraint.parallel,
        }
    return {
        "type": "triggered_tags",
        "triggers": [syntax.trigger],
        "tags": tags,
        "stop_after_first": not constraint.parallel,
    }


def _tag(xgr: Any, tool: ToolSchema, syntax: CallSyntax, mode: Mode) -> dict[str, Any]:
    name = json.dumps(tool.name, ensure_ascii=False)[1:-1]
    return {
        "type": "tag",
        "begin": syntax.prefix + name + syntax.infix,
        "content": {"type": "grammar", "grammar": _arguments_ebnf(xgr, tool, mode)},
        "end": syntax.end,
    }


def _enforced(tool: ToolSchema, mode: Mode) -> bool:
    return tool.parameters is not None and (tool.strict or mode != "auto")


def check_schemas(constraint: ToolConstraint) -> tuple[str, ...]:
    """The caps of ``limits`` on every argument schema the grammar will enforce
    (the others become "any object" and cost nothing); the keywords it cannot
    enforce, refused for a strict tool."""
    unenforced: list[str] = []
    for tool in constraint.tools:
        if tool.parameters is not None and _enforced(tool, constraint.mode):
            schema = json.loads(tool.parameters)
            limits.check_json_schema(schema, tool.param)
            review = review_schema(schema)
            limits.check_json_schema(review.schema, tool.param)  # folded lengths add repeats
            missed = review.unenforced
            if tool.strict:
                refuse_unenforced(missed, tool.param)
            unenforced += (f"{keyword} ({tool.param})" for keyword in missed)
    return tuple(unenforced)


def _arguments_ebnf(xgr: Any, tool: ToolSchema, mode: Mode) -> str:
    enforced = _enforced(tool, mode)
    schema = _ANY_OBJECT
    if enforced and tool.parameters is not None:
        schema = json.dumps(review_schema(json.loads(tool.parameters)).schema)
    try:
        # Compact JSON: small models loop on free whitespace otherwise.
        grammar = xgr.Grammar.from_json_schema(
            schema, any_whitespace=False, strict_mode=enforced and tool.strict
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequestError(
            f"invalid JSON schema for tool '{tool.name}': {clean_message(exc)}", param=tool.param
        ) from exc
    return json_safe_ebnf(str(grammar))


def _think_block(think: tuple[str, str]) -> dict[str, Any]:
    """An optional reasoning block before the calls: text up to the think end marker.

    The start marker is not required, as the chat template may have opened the
    block in the prompt already.
    """
    end = think[1]
    block = {
        "type": "tag",
        "begin": "",
        "content": {"type": "any_text", "excludes": [end]},
        "end": end,
    }
    spaced = {"type": "sequence", "elements": [block, {"type": "regex", "pattern": _AFTER_THINK}]}
    return {"type": "optional", "content": spaced}
