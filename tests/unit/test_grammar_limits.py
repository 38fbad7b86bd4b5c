"""The caps a request's grammar must stay under before anything is compiled."""

from __future__ import annotations

import json
from typing import Any

import pytest

from omlx.errors import InvalidRequestError
from omlx.grammar import limits
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import ToolConstraint, ToolSchema, check_schemas

PARAM = "response_format.json_schema.schema"
LIMIT = limits.MAX_REPEAT


def refusal(schema: Any) -> str:
    with pytest.raises(InvalidRequestError) as info:
        GrammarSpec.json_schema(schema, strict=True, param=PARAM)
    assert info.value.http_status == 400 and info.value.param == PARAM
    return info.value.message


def string_with(keyword: str, value: int) -> dict[str, Any]:
    kind = "string" if "Length" in keyword else "array" if "Items" in keyword else "object"
    return {"type": kind, keyword: value}


@pytest.mark.parametrize(
    "keyword",
    ["maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties"],
)
def test_each_bound_keyword_over_the_limit_is_named_with_its_path(keyword: str) -> None:
    schema = {"type": "object", "properties": {"name": string_with(keyword, 100_000)}}
    message = refusal(schema)
    assert message == (
        f"'{keyword}' 100000 at $.properties.name is above omlx's limit of {LIMIT} "
        "for enforced lengths"
    )
    GrammarSpec.json_schema(
        {"type": "object", "properties": {"name": string_with(keyword, LIMIT)}},
        strict=True,
        param=PARAM,
    )


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"$defs": {"big": {"type": "string", "maxLength": 10**9}}}, "$.$defs.big"),
        ({"items": {"items": {"maxItems": 5000}}}, "$.items.items"),
        ({"prefixItems": [{}, {"maxLength": 5000}]}, "$.prefixItems[1]"),
        (
            {"anyOf": [{"oneOf": [{"allOf": [{"minLength": 5000}]}]}]},
            "$.anyOf[0].oneOf[0].allOf[0]",
        ),
        ({"additionalProperties": {"maxLength": 5000}}, "$.additionalProperties"),
        ({"patternProperties": {"^x": {"minItems": 5000}}}, '$.patternProperties["^x"]'),
        ({"properties": {"a b": {"maxLength": 5000}}}, '$.properties["a b"]'),
    ],
)
def test_bounds_are_found_wherever_a_subschema_can_sit(schema: dict, path: str) -> None:
    assert f" at {path} is above" in refusal(schema)


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        ("a{1,100000}", "has the repetition {1,100000}"),
        ("[a-z]{5000}", "has the repetition {5000}"),
        (r"\d{2000,}", "has the repetition {2000,}"),
        ("(a{1,100}){1,100}", "nests repetitions up to 10000 times"),
        ("((ab){10}c{1,20}){1,10}x{0,1000}(?:y{1,2}){1,500}", None),
        # Escaped braces and braces inside a class are not quantifiers.
        (r"\{100000\}[{]100000}", None),
    ],
)
def test_pattern_quantifiers_are_capped_and_nested_ones_multiply(
    pattern: str, fragment: str | None
) -> None:
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}}
    if fragment is None:
        GrammarSpec.json_schema(schema, strict=True, param=PARAM)
        GrammarSpec.regex(pattern, "structured_outputs.regex")
        return
    message = refusal(schema)
    assert message.startswith("'pattern' at $.properties.code ") and fragment in message
    assert f"limit of {LIMIT}" in message
    with pytest.raises(InvalidRequestError, match="the regex .*" + fragment.split()[0]):
        GrammarSpec.regex(pattern, "structured_outputs.regex")


def test_patterns_of_one_schema_share_a_repetition_budget() -> None:
    def schema(n: int) -> dict:
        fields = {f"f{i}": {"type": "string", "pattern": "[a-z]{1,1000}"} for i in range(n)}
        return {"type": "object", "properties": fields}

    budget = limits.MAX_PATTERN_REPEAT_TOTAL // LIMIT
    GrammarSpec.json_schema(schema(budget), strict=True, param=PARAM)
    assert "patterns repeat up to" in refusal(schema(budget + 1))


def test_pattern_properties_keys_are_patterns_too() -> None:
    message = refusal({"type": "object", "patternProperties": {"^a{1,5000}$": {}}})
    assert "'patternProperties' key at $ has the repetition {1,5000}" in message


def test_many_declared_properties_in_one_object_are_refused() -> None:
    fields = {f"k{i}": {"type": "integer"} for i in range(limits.MAX_PROPERTIES + 1)}
    message = refusal({"type": "object", "properties": fields})
    assert f"declares {limits.MAX_PROPERTIES + 1} properties" in message
    fields.popitem()
    GrammarSpec.json_schema({"type": "object", "properties": fields}, strict=True, param=PARAM)


def test_a_schema_nested_ten_thousand_deep_is_refused_without_recursion() -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(10_000):
        schema = {"type": "array", "items": schema}
    message = refusal(schema)
    assert f"nests deeper than omlx's limit of {limits.MAX_SCHEMA_DEPTH} levels at $.items" in (
        message
    )
    deep_value: Any = 1
    for _ in range(10_000):
        deep_value = [deep_value]
    assert "the value at $.enum nests deeper" in refusal({"enum": [deep_value]})


def test_the_deepest_allowed_schema_is_accepted() -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(limits.MAX_SCHEMA_DEPTH - 1):
        schema = {"type": "array", "items": schema}
    GrammarSpec.json_schema(schema, strict=True, param=PARAM)
    assert "nests deeper" in refusal({"type": "array", "items": schema})


def test_sources_over_64_kib_are_refused_by_size() -> None:
    big = {"type": "object", "description": "x" * limits.MAX_SOURCE_BYTES}
    assert f"above omlx's limit of {limits.MAX_SOURCE_BYTES} bytes" in refusal(big)
    with pytest.raises(InvalidRequestError, match="the regex is 65537 bytes"):
        GrammarSpec.regex("a" * 65537, "structured_outputs.regex")
    with pytest.raises(InvalidRequestError, match="the grammar is"):
        GrammarSpec.ebnf('root ::= "' + "a" * 65536 + '"', "structured_outputs.grammar")
    with pytest.raises(InvalidRequestError, match="the choice list is"):
        GrammarSpec.choice(["x" * 70_000], "structured_outputs.choice")


def test_ebnf_repetition_ranges_are_capped_outside_strings() -> None:
    GrammarSpec.ebnf('root ::= "a{1,100000}" [{] "b"{0,1000}', "structured_outputs.grammar")
    with pytest.raises(InvalidRequestError, match=r"repetition \{2,100000\}, above"):
        GrammarSpec.ebnf('root ::= ("a" | "b"){2,100000}', "structured_outputs.grammar")


def test_choice_lists_are_capped_in_length() -> None:
    GrammarSpec.choice([str(i) for i in range(limits.MAX_CHOICES)], "structured_outputs.choice")
    with pytest.raises(InvalidRequestError, match="1001 choices is above"):
        GrammarSpec.choice([str(i) for i in range(1001)], "structured_outputs.choice")


def tool(schema: dict, *, strict: bool) -> ToolSchema:
    return ToolSchema.create("f", schema, strict=strict, param="tools[0].function.parameters")


def test_enforced_tool_schemas_go_through_the_same_caps() -> None:
    bomb = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 10**6}}}
    for constraint in (
        ToolConstraint("auto", (tool(bomb, strict=True),)),
        ToolConstraint("required", (tool(bomb, strict=False),)),
    ):
        with pytest.raises(InvalidRequestError) as info:
            check_schemas(constraint)
        assert info.value.param == "tools[0].function.parameters"
        assert "'maxLength' 1000000 at $.properties.q" in info.value.message
    # Not enforced (auto, not strict): the arguments are any object, nothing to cap.
    check_schemas(ToolConstraint("auto", (tool(bomb, strict=False),)))


def test_refusals_happen_before_serialising_the_whole_schema() -> None:
    # A megabyte of properties is refused by its first cap, not compiled or copied.
    fields = {f"k{i}": {"type": "string", "description": "d" * 100} for i in range(10_000)}
    schema = {"type": "object", "properties": fields}
    assert len(json.dumps(schema)) > 1_000_000
    assert "declares 10000 properties" in refusal(schema)
