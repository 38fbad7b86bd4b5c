"""Structured output with real weights (SmolLM2): varied schemas validate."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.fixtures.servers import live_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
S = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict]] = [
    (
        "a person",
        {
            "type": "object",
            "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    (
        "a city and its country",
        {
            "type": "object",
            "properties": {"city": S, "country": S},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    ),
    ("three colours", {"type": "array", "items": S, "minItems": 3, "maxItems": 3}),
    (
        "one to four fruits",
        {
            "type": "array",
            "items": {"enum": ["apple", "pear", "fig"]},
            "minItems": 1,
            "maxItems": 4,
        },
    ),
    (
        "a yes/no answer",
        {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    ),
    (
        "a temperature",
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
            "required": ["celsius"],
        },
    ),
    ("a mood", {"enum": ["happy", "sad", "neutral"]}),
    ("a short title", {"type": "string", "minLength": 3, "maxLength": 30}),
    ("a score", {"type": "integer", "minimum": 1, "maximum": 10}),
    (
        "a nested address",
        {
            "type": "object",
            "properties": {
                "name": S,
                "address": {
                    "type": "object",
                    "properties": {"street": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"],
                },
            },
            "required": ["name", "address"],
        },
    ),
    (
        "a book",
        {
            "type": "object",
            "properties": {
                "title": S,
                "year": {"type": "integer", "minimum": 1500, "maximum": 2030},
                "tags": {"type": "array", "items": S, "maxItems": 3},
            },
            "required": ["title", "year", "tags"],
        },
    ),
    ("an id or a name", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, S]}),
    (
        "a point",
        {
            "$defs": {"coord": {"type": "number", "minimum": -100, "maximum": 100}},
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/coord"}, "y": {"$ref": "#/$defs/coord"}},
            "required": ["x", "y"],
        },
    ),
    (
        "a list of points",
        {
            "$defs": {
                "p": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["x", "y"],
                }
            },
            "type": "array",
            "items": {"$ref": "#/$defs/p"},
            "minItems": 2,
            "maxItems": 3,
        },
    ),
    (
        "a pet",
        {
            "type": "object",
            "properties": {
                "kind": {"enum": ["cat", "dog"]},
                "name": S,
                "vaccinated": {"type": "boolean"},
            },
            "required": ["kind", "name", "vaccinated"],
        },
    ),
    (
        "a weekday",
        {
            "type": "object",
            "properties": {"day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}},
            "required": ["day"],
        },
    ),
    (
        "a price",
        {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0, "maximum": 1000},
                "currency": {"enum": ["EUR", "USD"]},
            },
            "required": ["amount", "currency"],
        },
    ),
    ("a pair of words", {"type": "array", "prefixItems": [S, S], "items": False, "minItems": 2}),
    (
        "a null or a number",
        {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 50}]},
    ),
    (
        "a recipe",
        {
            "type": "object",
            "properties": {
                "dish": S,
                "steps": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 30},
                    "minItems": 1,
                    "maxItems": 2,
                },
            },
            "required": ["dish", "steps"],
            "additionalProperties": False,
        },
    ),
    (
        "a flag set",
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    ),
]


@pytest.fixture(scope="module")
def client(
    smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator:
    with live_server(
        tmp_path_factory.mktemp("base"),
        smollm2_path.parent,
        scheduler={"max_concurrent_requests": 8},
        profiles=profiles_dir,
    ) as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def constrained(client: openai.OpenAI, what: str, schema: dict) -> tuple[str, str]:
    out = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=160,
        messages=[{"role": "user", "content": f"Reply with JSON for {what}."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "t", "schema": schema, "strict": True},
        },
    )
    return out.choices[0].message.content, out.choices[0].finish_reason


def test_twenty_schemas_each_yield_valid_json(client: openai.OpenAI) -> None:
    assert len(SCHEMAS) >= 20
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda case: constrained(client, *case), SCHEMAS))
    for (what, schema), (text, reason) in zip(SCHEMAS, results, strict=True):
        assert reason == "stop", (what, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_gives_an_object(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=120,
        response_format={"type": "json_object"},
        messages=[
            {
                "role": "user",
                "content": "Give a JSON object with the keys name and country for Paris.",
            }
        ],
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_regex_and_choice_with_real_weights(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=20,
        messages=[{"role": "user", "content": "When did the Berlin wall fall? Date only."}],
        extra_body={"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}},
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", out.choices[0].message.content)
    out = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=5,
        messages=[{"role": "user", "content": "Is Paris the capital of France?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert out.choices[0].message.content in ("yes", "no")


def test_mixed_batch_gives_each_request_its_kind_of_output(client: openai.OpenAI) -> None:
    def free(question: str) -> str:
        out = client.chat.completions.create(
            model=MODEL,
            temperature=0,
            max_tokens=30,
            messages=[{"role": "user", "content": question}],
        )
        return out.choices[0].message.content

    free_solo = free("What is the capital of France?")
    jobs = [
        lambda: constrained(client, *SCHEMAS[0]),
        lambda: free("What is the capital of France?"),
        lambda: constrained(client, *SCHEMAS[1]),
    ]
    with ThreadPoolExecutor(3) as pool:
        person, free_text, city = [f.result() for f in [pool.submit(j) for j in jobs]]
    jsonschema.validate(json.loads(person[0]), SCHEMAS[0][1])
    jsonschema.validate(json.loads(city[0]), SCHEMAS[1][1])
    assert free_text == free_solo and "Paris" in free_text
