"""Parsing structured-output request fields, and the logits mask."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from omlx.api.schemas import ChatCompletionRequest
from omlx.api.structured import grammar_spec
from omlx.errors import InvalidRequestError
from omlx.grammar.processor import apply_bitmask

MSG = [{"role": "user", "content": "x"}]


def spec_of(**fields):
    return grammar_spec(ChatCompletionRequest(model="m", messages=MSG, **fields))


def test_free_text_has_no_grammar() -> None:
    assert spec_of() is None
    assert spec_of(response_format={"type": "text"}) is None


def test_response_format_json_schema_and_json_object() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = spec_of(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": schema, "strict": True},
        }
    )
    assert spec.kind == "json_schema" and spec.strict is True
    assert json.loads(spec.source) == schema
    # Key order does not change the cache key.
    reordered = dict(reversed(list(schema.items())))
    again = spec_of(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": reordered, "strict": True},
        }
    )
    assert again.cache_key == spec.cache_key
    assert spec_of(response_format={"type": "json_object"}).kind == "json_object"


def test_extension_kinds() -> None:
    assert spec_of(structured_outputs={"regex": r"\d+"}).source == r"\d+"
    assert spec_of(structured_outputs={"grammar": 'root ::= "a"'}).kind == "grammar"
    assert json.loads(spec_of(structured_outputs={"json": '{"type": "integer"}'}).source) == {
        "type": "integer"
    }
    choice = spec_of(structured_outputs={"choice": ['say "hi"', "bye"]})
    assert choice.choice_ebnf() == 'root ::= "say \\"hi\\"" | "bye"'


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_field(fields, param) -> None:
    with pytest.raises(InvalidRequestError) as info:
        spec_of(**fields)
    assert info.value.http_status == 400 and info.value.param == param


def test_apply_bitmask_keeps_exactly_the_allowed_tokens() -> None:
    rng = np.random.default_rng(0)
    vocab = 100  # not a multiple of 32: the last word is partly unused
    allowed = rng.random(vocab) < 0.3
    words = np.zeros((1, (vocab + 31) // 32), dtype=np.uint32)
    for token in np.flatnonzero(allowed):
        words[0, token // 32] |= np.uint32(1) << np.uint32(token % 32)
    logits = mx.array(rng.normal(size=(1, vocab)).astype(np.float32))
    masked = np.array(apply_bitmask(logits, words.view(np.int32)))
    assert masked.shape == (1, vocab)
    assert np.all(np.isneginf(masked[0, ~allowed]))
    np.testing.assert_array_equal(masked[0, allowed], np.array(logits)[0, allowed])
