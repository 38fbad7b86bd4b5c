"""What the grammar enforces of a JSON schema: the review's rewrites and reports,
then random walks through real xgrammar grammars checked with validators."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import jsonschema_rs
import numpy as np
import pytest

from omlx.errors import InvalidRequestError
from omlx.grammar.compiler import import_xgrammar, json_safe_ebnf
from omlx.grammar.schema_review import (
    optional_groups_as_alternatives,
    refuse_unenforced,
    review_schema,
)
from omlx.grammar.spec import GrammarSpec


def unenforced(schema: dict[str, Any]) -> tuple[str, ...]:
    return review_schema(schema).unenforced


def rewritten(schema: dict[str, Any]) -> dict[str, Any]:
    return review_schema(schema).schema


def test_keywords_xgrammar_ignores_are_reported_with_their_path() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "role": {"type": "string", "not": {"const": "admin"}},
            "rating": {"type": "number", "multipleOf": 0.5},
        },
        "dependentRequired": {"a": ["b"]},
    }
    assert set(unenforced(schema)) == {
        "uniqueItems at $.properties.tags",
        "not at $.properties.role",
        "multipleOf at $.properties.rating",
        "dependentRequired at $",
    }
    # The request's schema is left alone; the review works on a copy.
    assert schema["properties"]["tags"]["uniqueItems"] is True


def test_a_single_item_array_is_unique_anyway() -> None:
    assert unenforced({"type": "array", "maxItems": 1, "uniqueItems": True}) == ()


def test_formats_become_the_stricter_patterns_and_unknown_ones_are_reported() -> None:
    date = rewritten({"type": "string", "format": "date"})
    assert "format" not in date and date["pattern"].startswith("^(")
    assert rewritten({"type": "string", "format": "uuid"})["format"] == "uuid"
    assert unenforced({"type": "string", "format": "iri"}) == ("format at $",)
    # A format JSON Schema does not define asserts nothing: there is nothing to refuse.
    password = {"type": "string", "format": "password", "maxLength": 64}
    assert unenforced(password) == ()
    assert rewritten(password) == {"type": "string", "maxLength": 64}
    # A length every value of the format already has is fine; a tighter one is not.
    assert unenforced({"type": "string", "format": "uuid", "maxLength": 36}) == ()
    assert unenforced({"type": "string", "format": "email", "maxLength": 20}) == ("maxLength at $",)
    assert unenforced({"type": "string", "format": "date", "pattern": "^2"}) == ("pattern at $",)


def test_a_length_folds_into_a_pattern_of_one_repeated_class() -> None:
    schema = {"type": "string", "pattern": "^[a-z0-9_]+$", "minLength": 3, "maxLength": 16}
    assert rewritten(schema) == {"type": "string", "pattern": "^[a-z0-9_]{3,16}$"}
    assert rewritten({"type": "string", "pattern": r"\d*", "maxLength": 4})["pattern"] == (
        r"^\d{0,4}$"
    )
    other = {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "maxLength": 40}
    assert unenforced(other) == ("maxLength at $",)


def test_optional_groups_are_written_as_alternatives() -> None:
    assert optional_groups_as_alternatives(r"^\d{5}(-\d{4})?$") == r"^\d{5}(-\d{4}|)$"
    assert optional_groups_as_alternatives(r"^(a(b+)?)?$") == r"^(a(b+|)|)$"
    # Escaped parentheses, classes and lazy quantifiers are left alone.
    for pattern in (r"\(x\)?", r"[(]?x", "(a)??"):
        assert optional_groups_as_alternatives(pattern) == pattern


def test_siblings_of_anyof_go_into_each_branch() -> None:
    schema = {
        "type": "object",
        "properties": {"email": {"type": "string"}, "phone": {"type": "string"}},
        "anyOf": [{"required": ["email"]}, {"required": ["phone"]}],
    }
    out = rewritten(schema)
    assert set(out) == {"anyOf"}
    assert [b["required"] for b in out["anyOf"]] == [["email"], ["phone"]]
    assert all(b["type"] == "object" for b in out["anyOf"])
    clash = {"type": "string", "anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert unenforced(clash) == ("type at $",)


def test_no_merge_changes_what_additional_properties_or_items_allow() -> None:
    # Beside no properties, additionalProperties: false allows only {}; moved next to a
    # branch's properties it would allow them.
    closed = {
        "type": "object",
        "additionalProperties": False,
        "anyOf": [{"properties": {"a": {"type": "integer"}}}, {"required": ["b"]}],
    }
    assert set(unenforced(closed)) == {"type at $", "additionalProperties at $"}
    tuple_items = {"allOf": [{"prefixItems": [{"type": "integer"}]}, {"items": False}]}
    assert unenforced(tuple_items) == ("allOf at $",)


def test_allof_merges_unless_parts_disagree() -> None:
    merged = rewritten({"allOf": [{"type": "integer"}, {"minimum": 5}]})
    assert merged == {"type": "integer", "minimum": 5}
    closed = {
        "allOf": [
            {"type": "object", "properties": {"a": {}}, "additionalProperties": False},
            {"properties": {"b": {}}},
        ]
    }
    assert unenforced(closed) == ("allOf at $",)


def test_oneof_is_enforced_only_when_its_branches_cannot_overlap() -> None:
    assert unenforced({"oneOf": [{"type": "string"}, {"type": "integer"}]}) == ()
    assert unenforced({"oneOf": [{"type": "integer"}, {"type": "number"}]}) == ("oneOf at $",)
    tagged = {
        "$defs": {
            "A": {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
            "B": {"type": "object", "properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]},
        },
        "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
    }
    assert unenforced(tagged) == ()


def test_keywords_beside_ref_and_enum_are_reported() -> None:
    assert unenforced({"$ref": "#/$defs/x", "maxLength": 3, "description": "d"}) == (
        "maxLength at $",
    )
    assert unenforced({"type": "string", "enum": ["S", "XXL"], "maxLength": 2}) == (
        "maxLength at $",
    )
    # Without a type, xgrammar does not apply string or number keywords.
    assert unenforced({"minimum": 2}) == ("minimum at $",)


def test_integer_multiple_of_needs_both_bounds_or_none() -> None:
    assert unenforced({"type": "integer", "multipleOf": 5}) == ()
    assert unenforced({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}) == ()
    assert unenforced({"type": "integer", "multipleOf": 5, "minimum": 0}) == ("multipleOf at $",)
    wide = {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100000}
    assert unenforced(wide) == ("multipleOf at $",)
    assert rewritten({"type": "integer", "minimum": 0.5, "maximum": 9.5}) == {
        "type": "integer",
        "minimum": 1,
        "maximum": 9,
    }


def test_unevaluated_properties_alone_is_additional_properties() -> None:
    schema = {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False}
    assert rewritten(schema)["additionalProperties"] is False
    assert unenforced(schema) == ()


def test_required_names_missing_from_properties_are_declared() -> None:
    schema = {
        "type": "object",
        "properties": {"b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": {"type": "string"},
    }
    assert rewritten(schema)["properties"] == {"b": {"type": "integer"}, "a": {"type": "string"}}
    assert rewritten({"type": "object", "required": ["a"]})["properties"] == {"a": {}}
    closed = {"type": "object", "required": ["a"], "additionalProperties": False}
    assert unenforced(closed) == ("required at $",)


def test_nothing_inside_an_ignored_subschema_is_reported_twice() -> None:
    schema = {"type": "object", "if": {"properties": {"a": {"minimum": 1}}}, "then": {"x": 1}}
    assert unenforced(schema) == ("if at $",)


def test_strict_refusal_names_keyword_path_and_the_way_out() -> None:
    with pytest.raises(InvalidRequestError) as info:
        refuse_unenforced(("uniqueItems at $.properties.tags",), "response_format.json_schema")
    error = info.value
    assert error.param == "response_format.json_schema" and error.code == (
        "unsupported_schema_keyword"
    )
    assert "uniqueItems at $.properties.tags" in error.message
    assert "strict: false" in error.message
    refuse_unenforced((), "p")  # nothing to refuse


def test_grammar_spec_refuses_only_when_strict() -> None:
    schema = {"type": "array", "uniqueItems": True}
    with pytest.raises(InvalidRequestError):
        GrammarSpec.json_schema(schema, strict=True, param="p")
    lenient = GrammarSpec.json_schema(schema, strict=False, param="p")
    assert lenient.unenforced == ("uniqueItems at $",)
    extension = GrammarSpec.json_schema(schema, strict=True, param="p", refuse=False)
    assert extension.unenforced == ("uniqueItems at $",)


# ---- random walks through real grammars ----------------------------------------------

STOP = 256


@pytest.fixture(scope="module")
def byte_compiler() -> Any:
    """xgrammar over a vocabulary of the 256 single bytes plus a stop token."""
    xgr = import_xgrammar()
    vocab = [bytes([i]) for i in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[STOP])
    return xgr, xgr.GrammarCompiler(info, cache_enabled=False)


def walk(xgr: Any, compiled: Any, rng: random.Random) -> str | None:
    """One random output the grammar allows (mostly printable bytes), or None if it
    runs past 200 bytes."""
    matcher = xgr.GrammarMatcher(compiled)
    mask = np.zeros((1, (STOP + 32) // 32), dtype=np.int32)
    out = bytearray()
    for _ in range(200):
        matcher.fill_next_token_bitmask(mask)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: STOP + 1])
        if STOP in allowed and (rng.random() < 0.25 or len(allowed) == 1):
            return out.decode("utf-8")
        choices = [int(t) for t in allowed if t != STOP]
        printable = [t for t in choices if 32 <= t < 127]
        token = rng.choice(printable if printable and rng.random() < 0.9 else choices)
        assert matcher.accept_token(token)
        out.append(token)
    return None


WALKED = [
    {"type": "string", "format": name}
    for name in (
        "date",
        "time",
        "date-time",
        "ipv4",
        "ipv6",
        "hostname",
        "email",
        "uuid",
        "uri",
        "duration",
        "json-pointer",
    )
] + [
    {"type": "string", "maxLength": 5},
    {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "propertyNames": {"maxLength": 3},
    },
    {"type": "string", "pattern": r"^\+?[0-9]{1,3}(-[0-9]+)?$"},
    {"type": "string", "pattern": "^[a-z0-9_]+$", "minLength": 3, "maxLength": 8},
    {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["a"]},
]


@pytest.mark.parametrize("schema", WALKED, ids=lambda s: s.get("format") or json.dumps(s))
def test_every_walk_through_the_grammar_validates(byte_compiler: Any, schema: dict) -> None:
    xgr, compiler = byte_compiler
    grammar = xgr.Grammar.from_json_schema(
        json.dumps(review_schema(schema).schema), any_whitespace=False
    )
    compiled = compiler.compile_grammar(json_safe_ebnf(str(grammar)))
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    validator = jsonschema.Draft202012Validator(schema, format_checker=checker)
    strict_formats = jsonschema_rs.validator_for(schema, validate_formats=True)
    rng = random.Random(7)
    outputs = [walk(xgr, compiled, rng) for _ in range(60)]
    done = [text for text in outputs if text is not None]
    assert len(done) >= 30
    for text in done:
        value = json.loads(text)  # strict: a raw control character would fail here
        assert validator.is_valid(value) and strict_formats.is_valid(value), text


def test_the_caps_hold_for_the_rewritten_schema_too() -> None:
    # Each folded length is a bounded repetition xgrammar pays for at compile time.
    field = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 1000}
    schema = {"type": "object", "properties": {f"f{i}": field for i in range(12)}}
    with pytest.raises(InvalidRequestError) as info:
        GrammarSpec.json_schema(schema, strict=False, param="p")
    assert "repeat" in info.value.message
    GrammarSpec.json_schema({**schema, "properties": {"f": field}}, strict=False, param="p")
