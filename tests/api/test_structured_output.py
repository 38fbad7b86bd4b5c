"""Structured output on the tiny random models: the mask alone makes output valid."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from omlx.api.server import Server

MSG = [{"role": "user", "content": "Answer please."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["n", "ok", "tag"],
    "additionalProperties": False,
}


def ask(client: openai.OpenAI, model: str = "tiny-llama", stream: bool = False, **kw) -> tuple:
    args = {"model": model, "messages": MSG, "temperature": 0, "max_tokens": 60, **kw}
    if not stream:
        out = client.chat.completions.create(**args)
        return out.choices[0].message.content, out.choices[0].finish_reason
    chunks = list(client.chat.completions.create(stream=True, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].choices[0].finish_reason


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_json_schema_output_validates(client: openai.OpenAI, model: str) -> None:
    text, reason = ask(client, model, response_format=schema_format(SCHEMA))
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert ask(client, model, stream=True, response_format=schema_format(SCHEMA)) == (text, reason)


def test_json_object_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    text, reason = ask(
        client, response_format={"type": "json_object"}, max_tokens=200, seed=1, temperature=0.7
    )
    # A random model may wander through keys until max_tokens; an object it is.
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    text, reason = ask(client, extra_body={"structured_outputs": {"regex": r"[a-z]{3,8}"}})
    assert re.fullmatch(r"[a-z]{3,8}", text) and reason == "stop"
    text, _ = ask(client, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert text in ("alpha", "beta")
    ebnf = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'
    text, reason = ask(client, extra_body={"structured_outputs": {"grammar": ebnf}}, max_tokens=12)
    # A random model may keep adding digits until max_tokens; the prefix is still valid.
    assert re.fullmatch(r"\(\d+\)" if reason == "stop" else r"\(\d*", text), (text, reason)


def test_completions_endpoint_takes_the_same_constraints(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny-llama",
        prompt="Colour:",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )
    assert out.choices[0].text in ("red", "blue")


def test_constrained_and_free_requests_batch_without_mixing(client: openai.OpenAI) -> None:
    jobs = [
        {"response_format": schema_format(SCHEMA)},
        {},
        {"extra_body": {"structured_outputs": {"regex": r"[0-9]{2,6}"}}},
        {"max_tokens": 30},
    ] * 2
    solo = [ask(client, **job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: ask(client, stream=True, **job), jobs))
    assert together == solo
    jsonschema.validate(json.loads(solo[0][0]), SCHEMA)
    assert re.fullmatch(r"[0-9]{2,6}", solo[2][0])


def _delta(sse_line: str) -> str:
    """The content of one chat-stream SSE line ("" for keep-alives, [DONE], usage)."""
    if not sse_line.startswith("data: {"):
        return ""
    choices = json.loads(sse_line[6:])["choices"]
    return (choices[0]["delta"].get("content") or "") if choices else ""


def test_a_constrained_request_keeps_its_grammar_when_others_join(
    client: openai.OpenAI, server: Server
) -> None:
    expected = ask(client, response_format=schema_format(SCHEMA))
    body = {
        "model": "tiny-llama",
        "messages": MSG,
        "temperature": 0,
        "max_tokens": 60,
        "stream": True,
        "response_format": schema_format(SCHEMA),
    }
    text = ""
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json=body, timeout=60
    ) as resp:
        lines = resp.iter_lines()
        for line in lines:  # decode alone (unbatched) for a few tokens
            text += _delta(line)
            if len(text) >= 4:
                break
        with ThreadPoolExecutor(3) as pool:  # others join: it moves into the batch
            others = [pool.submit(ask, client, max_tokens=20) for _ in range(3)]
            text += "".join(_delta(line) for line in lines)
            [f.result() for f in others]
    assert text == expected[0]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"structured_outputs": {"regex": "([a-"}}, "invalid regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "invalid grammar"),
        (
            {
                "response_format": schema_format(
                    {
                        "type": "object",
                        "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                    }
                )
            },
            "invalid JSON schema",
        ),
    ],
)
def test_invalid_constraints_are_400_with_the_compiler_message(
    server: Server, extra, fragment
) -> None:
    body = {"model": "tiny-llama", "messages": MSG, **extra}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert fragment in err["message"] and "/project/" not in err["message"]
