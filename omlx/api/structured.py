"""Request fields that constrain the output: OpenAI ``response_format`` and the
``structured_outputs`` extension (json, regex, grammar, choice)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Response

from omlx.api.schemas import ChatCompletionRequest, CompletionRequest
from omlx.api.tool_grammar import tool_grammar_spec
from omlx.engine.model_engine import ModelEngine
from omlx.errors import InvalidRequestError
from omlx.grammar.compile_pool import CompilePool
from omlx.grammar.schema_review import UNENFORCED_HEADER
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import ToolConstraint

log = logging.getLogger(__name__)

_EXTENSION_KINDS = ("json", "regex", "grammar", "choice")
# Header values are latin-1 and proxies cap their size: keep the list short.
_HEADER_MAX_CHARS = 2000


def grammar_spec(body: ChatCompletionRequest | CompletionRequest) -> GrammarSpec | None:
    """The constraint a request asks for, validated; None for free text."""
    from_format = _from_response_format(body.response_format)
    from_extension = extension_spec(body.structured_outputs)
    if from_format and from_extension:
        raise InvalidRequestError(
            "use either response_format or structured_outputs, not both", param="structured_outputs"
        )
    return from_format or from_extension


def _from_response_format(fmt: dict[str, Any] | None) -> GrammarSpec | None:
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise InvalidRequestError(
            f"response_format type '{kind}' is not one of text, json_object, json_schema",
            param="response_format.type",
        )
    spec = (fmt or {}).get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidRequestError(
            "response_format.json_schema.schema must be a JSON schema object",
            param="response_format.json_schema.schema",
        )
    return GrammarSpec.json_schema(
        spec["schema"], strict=bool(spec.get("strict")), param="response_format.json_schema.schema"
    )


def extension_spec(ext: dict[str, Any] | None) -> GrammarSpec | None:
    if not ext:
        return None
    given = [k for k in _EXTENSION_KINDS if ext.get(k) is not None]
    if len(given) != 1:
        raise InvalidRequestError(
            "structured_outputs takes exactly one of: " + ", ".join(_EXTENSION_KINDS),
            param="structured_outputs",
        )
    kind = given[0]
    value = ext[kind]
    param = f"structured_outputs.{kind}"
    if kind == "json":
        schema = value
        if isinstance(value, str):
            import json

            try:
                schema = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"invalid JSON schema: {exc}", param=param) from exc
        if not isinstance(schema, dict):
            raise InvalidRequestError("a JSON schema object is required", param=param)
        # strict: xgrammar's no-extra-keys mode; the extension has no strict flag to refuse on.
        return GrammarSpec.json_schema(schema, strict=True, param=param, refuse=False)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise InvalidRequestError("choice must be a non-empty list of strings", param=param)
        return GrammarSpec.choice(value, param)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{kind} must be a non-empty string", param=param)
    return GrammarSpec.regex(value, param) if kind == "regex" else GrammarSpec.ebnf(value, param)


async def bind_grammar(
    engine: ModelEngine, spec: GrammarSpec | ToolConstraint | None, pool: CompilePool
) -> Any:
    """Compile ``spec`` for the engine's tokenizer on the grammar pool, within its
    time bound (cached); a tool constraint is first written in the model's
    tool-call syntax."""
    if spec is None:
        return None
    from omlx.grammar.processor import BoundGrammar

    compiler = await asyncio.to_thread(engine.grammar_compiler)
    compiled = compiler.cached(spec) if isinstance(spec, GrammarSpec) else None
    if compiled is None:

        def work() -> Any:
            grammar = (
                spec if isinstance(spec, GrammarSpec) else tool_grammar_spec(engine.tokenizer, spec)
            )
            return compiler.compile(grammar)

        what = "tool-call grammar" if isinstance(spec, ToolConstraint) else spec.what
        compiled = await pool.run((compiler, spec), work, what=what, param=spec.param)
    return BoundGrammar(compiled, compiler)


def with_unenforced_header(
    response: Response, spec: GrammarSpec | ToolConstraint | None, request_id: str
) -> Response:
    """``response`` with the X-Omlx-Unenforced-Schema-Keywords header (and a log
    line) when the request's schema has keywords the grammar did not enforce."""
    unenforced = spec.unenforced if spec is not None else ()
    if unenforced:
        listed = "; ".join(unenforced)
        log.warning("%s: schema keywords not enforced by the grammar: %s", request_id, listed)
        value = listed.encode("ascii", "backslashreplace").decode("ascii")
        if len(value) > _HEADER_MAX_CHARS:
            value = value[: _HEADER_MAX_CHARS - 5].rsplit("; ", 1)[0] + "; ..."
        response.headers[UNENFORCED_HEADER] = value
    return response
