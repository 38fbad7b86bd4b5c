"""Grammar bombs against a live server: refused at once, bounded, and harmless to the batch."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

MSG = [{"role": "user", "content": "Answer please."}]
HEADERS = {"X-Omlx-Client": "test"}


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("base"),
        tiny_models_dir,
        scheduler={"max_concurrent_requests": 8, "prefill_step_size": 64},
        profiles=profiles_dir,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    free(client)  # load the model now: the time bounds below are the grammar's alone
    return client


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


def nested(depth: int) -> dict:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def big_schema() -> dict:
    """About a megabyte: many short properties, each with a long description."""
    fields = {f"k{i}": {"type": "string", "description": "d" * 500} for i in range(2000)}
    return {"type": "object", "properties": fields}


BOMBS: list[tuple[str, dict, str]] = [
    (
        "maxLength",
        {"response_format": schema_format({"type": "string", "maxLength": 10**9})},
        "'maxLength' 1000000000 at $ is above omlx's limit of 1000",
    ),
    (
        "pattern",
        {
            "response_format": schema_format(
                {
                    "type": "object",
                    "properties": {"id": {"type": "string", "pattern": "a{1,100000}"}},
                }
            )
        },
        "'pattern' at $.properties.id has the repetition {1,100000}",
    ),
    (
        "regex",
        {"extra_body": {"structured_outputs": {"regex": "(a{1,100}){1,100}"}}},
        "the regex nests repetitions up to 10000 times",
    ),
    (
        "ebnf",
        {"extra_body": {"structured_outputs": {"grammar": 'root ::= ("a" | "b"){1,100000}'}}},
        "the grammar has the repetition {1,100000}",
    ),
    (
        "choice",
        {"extra_body": {"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}},
        "100000 choices is above omlx's limit of 1000",
    ),
    ("megabyte", {"response_format": schema_format(big_schema())}, "declares 2000 properties"),
    ("deep", {"response_format": schema_format(nested(500))}, "nests deeper than omlx's limit"),
    (
        "tool",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "strict": True,
                        "parameters": {
                            "type": "object",
                            "properties": {"q": {"type": "array", "minItems": 10**7}},
                        },
                    },
                }
            ],
            "tool_choice": "required",
        },
        "'minItems' 10000000 at $.properties.q",
    ),
]


@pytest.mark.parametrize(("name", "kw", "fragment"), BOMBS, ids=[b[0] for b in BOMBS])
def test_grammar_bombs_are_400_at_once(
    client: openai.OpenAI, name: str, kw: dict, fragment: str
) -> None:
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=10, **kw)
    assert time.monotonic() - start < 5
    assert fragment in info.value.message


def test_a_bomb_on_the_messages_api_is_400_too(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10**8}}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="tiny-llama",
            max_tokens=10,
            messages=MSG,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
        )
    assert "'maxLength' 100000000 at $.properties.s" in str(info.value)


def test_json_nested_past_the_parser_is_a_client_error(server: Server) -> None:
    body = json.dumps({"model": "tiny-llama", "messages": MSG, "response_format": "X"}).replace(
        '"X"', '{"type": "json_schema", "json_schema": {"name": "t", "schema": ' + "[" * 100_000
    )
    resp = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=body,
        headers={**HEADERS, "Content-Type": "application/json"},
        timeout=30,
    )
    assert 400 <= resp.status_code < 500, resp.text
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def slow_schema() -> dict:
    """Under every cap, yet slow to compile: many optional properties (~0.1-0.5 s
    here). Fresh names each time, so the compile cache never has it."""
    tag = secrets.token_hex(4)
    fields = {f"{tag}_{i}": {"type": "integer"} for i in range(250)}
    return {"type": "object", "properties": fields}


def free(client: openai.OpenAI, max_tokens: int = 40) -> tuple[str | None, str]:
    out = client.chat.completions.create(
        model="tiny-llama", messages=MSG, temperature=0, max_tokens=max_tokens
    )
    return out.choices[0].message.content, out.choices[0].finish_reason


def test_a_compile_past_its_time_bound_is_400_and_the_server_keeps_serving(
    server: Server, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = free(client)
    monkeypatch.setattr(server.app.state.omlx.compile_pool, "timeout_s", 0.02)
    schema = slow_schema()
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-llama",
            messages=MSG,
            max_tokens=10,
            response_format=schema_format(schema),
        )
    assert time.monotonic() - start < 5
    assert "the JSON schema took longer than 0.02 s to compile; simplify it" in info.value.message
    assert free(client) == alone
    monkeypatch.undo()
    # With the usual bound the same schema compiles (or is already cached) and is obeyed.
    out = client.chat.completions.create(
        model="tiny-llama",
        messages=MSG,
        temperature=0,
        max_tokens=200,
        response_format=schema_format(schema),
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


# Strings of a and b, each in exponentially many parses: every token costs the
# matcher more than the last (an Earley parse of an ambiguous grammar). The tiny
# model never picks the "~~" that would end it.
AMBIGUOUS = 'root ::= s "~~"\ns ::= s s | "a" | "b"'


def test_an_ambiguous_grammar_ends_its_request_not_the_batch(client: openai.OpenAI) -> None:
    alone = free(client, max_tokens=300)
    with ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        bomb = pool.submit(
            client.chat.completions.create,
            model="tiny-llama",
            messages=MSG,
            temperature=0,
            max_tokens=2000,
            extra_body={"structured_outputs": {"grammar": AMBIGUOUS}},
        )
        beside = pool.submit(free, client, max_tokens=300)
        assert beside.result(timeout=60) == alone
        # Ended with an error naming the cause, never a truncated "stop" answer
        # whose text the grammar does not accept.
        with pytest.raises(openai.BadRequestError, match="too ambiguous"):
            bomb.result(timeout=60)
    # Without the per-step bound this request runs for many minutes and every
    # step of the batch waits on it.
    assert time.monotonic() - start < 60
