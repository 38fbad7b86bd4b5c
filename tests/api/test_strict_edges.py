"""Strict edges: unknown API routes and wrong methods answer in the OpenAI error
envelope naming what exists, and a field of the wrong JSON type is a 400 naming
it (a string is not a number, 8.5 is not an integer), as OpenAI answers."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from omlx.api.server import Server

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "Hi"}]
ENVELOPE_KEYS = {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/nothing"),
        ("POST", "/v1/chat/complete"),
        ("DELETE", "/v1/engines/x"),
        ("PUT", "/v1/models-list"),
        ("PATCH", "/v1/"),
    ],
)
def test_unknown_api_route_is_404_naming_the_endpoints(
    server: Server, method: str, path: str
) -> None:
    answer = httpx.request(method, server.base_url + path, json={}, timeout=30)
    assert answer.status_code == 404, answer.text
    error = answer.json()["error"]
    assert set(error) == ENVELOPE_KEYS
    assert error["type"] == "not_found_error" and error["code"] == "unknown_url"
    assert f"({method} {path})" in error["message"]
    for endpoint in ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"):
        assert endpoint in error["message"], error["message"]
    assert "GET /v1/models/{model_id}" in error["message"]  # no ":path" converter shown


def test_the_openai_client_gets_a_not_found_error_it_can_read(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.fine_tuning.jobs.list()
    assert info.value.status_code == 404
    assert "POST /v1/chat/completions" in info.value.message


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("DELETE", "/v1/models", "GET"),
    ],
)
def test_wrong_method_on_a_known_route_is_405_in_the_envelope(
    server: Server, method: str, path: str, allowed: str
) -> None:
    # A JSON content type: the origin guard wants one on a body-less PUT / DELETE.
    headers = {"Content-Type": "application/json"}
    answer = httpx.request(method, server.base_url + path, headers=headers, timeout=30)
    assert answer.status_code == 405, answer.text
    error = answer.json()["error"]
    assert set(error) == ENVELOPE_KEYS
    assert error["code"] == "method_not_allowed"
    assert f"takes {allowed}" in error["message"] and method in error["message"]
    assert answer.headers["allow"] == allowed


def test_a_handlers_own_404_keeps_its_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert "no-such-model" in info.value.message
    assert "Invalid URL" not in info.value.message


def test_anthropic_paths_keep_the_anthropic_error_shape(server: Server) -> None:
    answer = httpx.get(server.base_url + "/v1/messages", timeout=30)
    assert answer.status_code == 405
    body = answer.json()
    assert body["type"] == "error" and "takes POST" in body["error"]["message"]


CHAT_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
MESSAGES_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {**CHAT_BODY, "max_tokens": "4"}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT_BODY, "max_tokens": 4.5}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT_BODY, "max_tokens": 4.0}, "max_tokens"),
        (
            "/v1/chat/completions",
            {**CHAT_BODY, "max_completion_tokens": "4"},
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {**CHAT_BODY, "temperature": "0.5"}, "temperature"),
        ("/v1/chat/completions", {**CHAT_BODY, "top_p": "1"}, "top_p"),
        ("/v1/chat/completions", {**CHAT_BODY, "seed": "7"}, "seed"),
        ("/v1/chat/completions", {**CHAT_BODY, "top_k": 2.5}, "top_k"),
        ("/v1/chat/completions", {**CHAT_BODY, "n": "1"}, "n"),
        ("/v1/chat/completions", {**CHAT_BODY, "stop_token_ids": ["2"]}, "stop_token_ids[0]"),
        (
            "/v1/chat/completions",
            {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": "true"}},
            "stream_options.include_usage",
        ),
        (
            "/v1/chat/completions",
            {**CHAT_BODY, "messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": "4"}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "echo": 1}, "echo"),
        ("/v1/messages", {**MESSAGES_BODY, "max_tokens": "4"}, "max_tokens"),
        ("/v1/messages", {**MESSAGES_BODY, "temperature": "0.5"}, "temperature"),
        ("/v1/messages", {**MESSAGES_BODY, "top_k": 1.5}, "top_k"),
        (
            "/v1/messages",
            {**MESSAGES_BODY, "thinking": {"type": "enabled", "budget_tokens": "64"}},
            "thinking.budget_tokens",
        ),
    ],
)
def test_a_field_of_the_wrong_type_is_a_400_naming_it(
    server: Server, path: str, body: dict[str, Any], field: str
) -> None:
    answer = httpx.post(server.base_url + path, json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert f"'{field}'" in answer.text, answer.text


def test_numbers_of_the_right_type_still_pass(client: openai.OpenAI, server: Server) -> None:
    # An integer is a number: temperature 1 and top_p 1 are fine, as on OpenAI.
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=2,
        temperature=1,
        top_p=1,
        seed=3,  # type: ignore[arg-type]
    )
    assert out.choices[0].finish_reason == "length"
    answer = httpx.post(
        server.base_url + "/v1/messages", json={**MESSAGES_BODY, "temperature": 0}, timeout=30
    )
    assert answer.status_code == 200, answer.text


def test_the_openai_client_sees_the_type_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens="4")  # type: ignore[arg-type]
    assert "max_tokens" in info.value.message
