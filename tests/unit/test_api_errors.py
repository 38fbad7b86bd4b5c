"""HTTP error envelope (omlx.api.errors) and SSE framing (omlx.api.sse)."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from omlx.api.errors import install_error_handlers
from omlx.api.schemas import ChatCompletionRequest
from omlx.api.sse import DONE, KEEPALIVE, sse_data
from omlx.errors import (
    ContextLengthExceededError,
    EngineError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
)

VALID_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/invalid")
    async def invalid() -> None:
        raise InvalidRequestError("'stop' must be short", param="stop")

    @app.get("/missing-model")
    async def missing_model() -> None:
        raise ModelNotFoundError("gpt-4", ["llama-3", "qwen/qwen3"])

    @app.get("/no-models")
    async def no_models() -> None:
        raise ModelNotFoundError("gpt-4", [])

    @app.get("/busy")
    async def busy() -> None:
        raise QueueFullError("server busy; retry shortly", retry_after_s=7)

    @app.get("/too-long")
    async def too_long() -> None:
        raise ContextLengthExceededError(
            "prompt is 5000 tokens; the limit is 4096", param="messages"
        )

    @app.get("/engine")
    async def engine() -> None:
        raise EngineError("generation failed: metal out of memory")

    @app.get("/crash")
    async def crash() -> None:
        raise RuntimeError("secret detail at /Users/me/private.py")

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict:
        return {"model": body.model, "num_messages": len(body.messages)}

    return TestClient(app, raise_server_exceptions=False)


def envelope(message: str, error_type: str, code: str | None, param: str | None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# ---- omlx errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "status", "body"),
    [
        (
            "/invalid",
            400,
            envelope("'stop' must be short", "invalid_request_error", "invalid_request", "stop"),
        ),
        (
            "/too-long",
            400,
            envelope(
                "prompt is 5000 tokens; the limit is 4096",
                "invalid_request_error",
                "context_length_exceeded",
                "messages",
            ),
        ),
        (
            "/busy",
            503,
            envelope("server busy; retry shortly", "overloaded_error", "queue_full", None),
        ),
        (
            "/engine",
            500,
            envelope(
                "generation failed: metal out of memory", "server_error", "engine_error", None
            ),
        ),
    ],
)
def test_omlx_errors_map_to_status_and_envelope(client, path, status, body):
    response = client.get(path)

    assert response.status_code == status
    assert response.json() == body


def test_queue_full_sets_retry_after(client):
    response = client.get("/busy")

    assert response.headers["retry-after"] == "7"


def test_other_errors_have_no_retry_after(client):
    assert "retry-after" not in client.get("/engine").headers


def test_model_not_found_lists_available_models(client):
    response = client.get("/missing-model")

    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "not_found_error",
        "model_not_found",
        "model",
    )
    assert "'gpt-4'" in error["message"]
    assert "llama-3, qwen/qwen3" in error["message"]


def test_model_not_found_without_models_says_so(client):
    message = client.get("/no-models").json()["error"]["message"]

    assert "Available models: none" in message


def test_unhandled_exception_is_a_500_envelope_without_details(client):
    response = client.get("/crash")

    assert response.status_code == 500
    assert response.json() == envelope(
        "internal error: RuntimeError", "server_error", "internal_error", None
    )
    assert "secret detail" not in response.text
    assert "Traceback" not in response.text


def test_unknown_route_uses_the_envelope(client):
    response = client.get("/nowhere")

    assert response.status_code == 404
    assert response.json() == envelope("Not Found", "not_found_error", None, None)


def test_wrong_method_uses_the_envelope(client):
    response = client.get("/chat")

    assert response.status_code == 405
    assert response.json()["error"]["type"] == "invalid_request_error"


# ---- request validation ----------------------------------------------------------------


def test_valid_body_passes(client):
    response = client.post("/chat", json={**VALID_CHAT, "unknown_field": 1})

    assert response.status_code == 200
    assert response.json() == {"model": "tiny", "num_messages": 1}


@pytest.mark.parametrize(
    ("body", "param", "in_message"),
    [
        ({**VALID_CHAT, "temperature": 3.5}, "temperature", "'temperature'"),
        ({"model": "tiny"}, "messages", "'messages' is required"),
        ({**VALID_CHAT, "messages": []}, "messages", "'messages'"),
        ({**VALID_CHAT, "n": 9}, "n", "'n'"),
        ({**VALID_CHAT, "top_p": 0}, "top_p", "'top_p'"),
        (
            {**VALID_CHAT, "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "'messages[0].role'",
        ),
        ({**VALID_CHAT, "stop": ["x"] * 17}, "stop", "at most 16 stop sequences"),
    ],
)
def test_validation_errors_are_400_naming_the_field(client, body, param, in_message):
    response = client.post("/chat", json=body)

    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_request",
        param,
    )
    assert in_message in error["message"]


def test_malformed_json_body_is_400(client):
    response = client.post(
        "/chat",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )

    assert response.status_code == 400
    assert response.json() == envelope(
        "request body is not valid JSON", "invalid_request_error", "invalid_request", None
    )


def test_body_that_is_not_an_object_is_400(client):
    response = client.post("/chat", json=[VALID_CHAT])

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] is None
    assert error["message"].startswith("request body:")


def test_list_items_are_named_with_their_index(client):
    response = client.post("/chat", json={**VALID_CHAT, "stop_token_ids": [3, -1]})

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stop_token_ids[1]"


def test_empty_body_says_the_body_is_required(client):
    response = client.post("/chat", content=b"", headers={"content-type": "application/json"})

    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "''" not in message
    assert "body" in message


# ---- SSE framing --------------------------------------------------------------------------


def test_sse_data_is_one_data_line_of_json():
    payload = {"choices": [{"delta": {"content": "line one\nline two\r\nend"}}]}

    event = sse_data(payload)

    assert event.startswith("data: ")
    assert event.endswith("\n\n")
    line = event.removesuffix("\n\n")
    assert "\n" not in line and "\r" not in line
    assert json.loads(line.removeprefix("data: ")) == payload


def test_sse_data_keeps_non_ascii_as_is():
    event = sse_data({"text": "日本語 🙂 é"})

    assert "日本語 🙂 é" in event
    assert "\\u" not in event


def test_done_is_a_data_event():
    assert DONE == "data: [DONE]\n\n"


def test_keepalive_is_a_single_comment_line():
    assert KEEPALIVE.startswith(":")
    assert KEEPALIVE.endswith("\n\n")
    assert "\n" not in KEEPALIVE.removesuffix("\n\n")
