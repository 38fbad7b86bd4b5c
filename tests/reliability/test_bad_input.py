"""Bad input against a real ``omlx serve`` with an API key and a small body limit:
malformed JSON, wrong content types, invalid UTF-8, bodies over the limit and
path traversal in model and output names. Each gets a clear 4xx in the route's
error shape; none gets a 5xx, and the server keeps serving afterwards."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.servers import serve_process
from tests.fixtures.tiny_models import CORPUS

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024
MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (method, path) of every route that reads a JSON body.
PYDANTIC_ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
]
RAW_JSON_ROUTES = [
    ("PUT", "/admin/api/settings"),
    ("PUT", f"/admin/api/models/{MODEL}/settings"),
    ("POST", f"/admin/api/models/{MODEL}/unload"),
    ("POST", "/admin/api/cache/clear"),
    ("POST", "/admin/api/models/import-gguf"),
    ("POST", "/admin/api/login"),
]
MALFORMED = [
    b"{",
    b'{"model": ',
    b"[1, 2",
    b"nul",
    b"{'single': 'quotes'}",
    b'{"a": 1}{"b": 2}',
    b"\x00\x01\x02",
    b"[" * 20000 + b"]" * 20000,
    b'"a string"',
    b"[]",
    b"null",
]
# Not UTF-8 (the third: a surrogate in CESU-8, which Python's JSON parser would take),
# and lone UTF-16 surrogate escapes, which no tokenizer or encoder accepts.
NOT_UNICODE = [
    (b'{"model": "\xff\xfe"}', "UTF-8"),
    (b'{"model": "\xc0\xaf"}', "UTF-8"),
    (b'{"x": "\xed\xa0\x80"}', "UTF-8"),
    (b'{"model": "tiny-llama", "api_key": "\\ud800", "prompt": "\\udfff"}', "surrogate"),
    (b'{"messages": [{"role": "user", "content": "a\\ud83d"}]}', "surrogate"),
]


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, Path]]:
    """(base URL, model dir, server log). A model dir of its own, so an import
    that wrongly succeeded could be seen and would not touch other tests."""
    root = tmp_path_factory.mktemp("bad-input")
    models = root / "models"
    models.mkdir()
    (models / MODEL).symlink_to(tiny_models_dir / MODEL, target_is_directory=True)
    log = root / "server.log"
    flags = ("--api-key", KEY, "--max-body-bytes", str(LIMIT), "--max-context-window", "256")
    with (
        log.open("w") as err,
        serve_process(root / "base", models, *flags, stderr=err) as (
            _,
            url,
        ),
    ):
        yield url, models, log
        # Still serving, and nothing reached the unexpected-error handler.
        reply = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60)
        assert reply.status_code == 200
    text = log.read_text()
    assert "unhandled error" not in text and "Traceback" not in text


def send(
    url: str,
    method: str,
    path: str,
    content: bytes | None = None,
    content_type: str | None = "application/json",
) -> httpx.Response:
    headers = {**AUTH, "content-type": content_type} if content_type else AUTH
    return httpx.request(method, url + path, content=content, headers=headers, timeout=60)


def valid_body(path: str, model: str = MODEL) -> dict:
    if path == "/v1/completions":
        return {"model": model, "prompt": "hi", "max_tokens": 2}
    return {**CHAT, "model": model}


def error_message(resp: httpx.Response, path: str) -> str:
    """The message of a 4xx in the route's shape (Anthropic's on /v1/messages)."""
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    body = resp.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
    assert set(body["error"]) >= {"message", "type"}
    return body["error"]["message"]


@pytest.mark.parametrize("route", PYDANTIC_ROUTES + RAW_JSON_ROUTES, ids=lambda r: r[1])
def test_malformed_json_is_a_clear_4xx(server: tuple[str, Path, Path], route: tuple) -> None:
    url = server[0]
    method, path = route
    for raw in MALFORMED:
        resp = send(url, method, path, raw)
        message = error_message(resp, path)
        assert message and "internal" not in message


@pytest.mark.parametrize("route", PYDANTIC_ROUTES + RAW_JSON_ROUTES, ids=lambda r: r[1])
def test_text_that_is_not_unicode_is_named_as_such(
    server: tuple[str, Path, Path], route: tuple
) -> None:
    url = server[0]
    method, path = route
    for raw, named in NOT_UNICODE:
        resp = send(url, method, path, raw)
        assert resp.status_code == 400
        assert named in error_message(resp, path)
    # A proper surrogate pair (what ensure_ascii JSON encoders send for emoji) is fine.
    emoji = b'{"model": "tiny-llama", "prompt": "\\ud83d\\ude00", "max_tokens": 1}'
    assert send(url, "POST", "/v1/completions", emoji).status_code == 200


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/xml",
        "",
    ],
)
def test_a_json_body_with_another_content_type_is_415(
    server: tuple[str, Path, Path], content_type: str
) -> None:
    url = server[0]
    for method, path in PYDANTIC_ROUTES:
        resp = send(url, method, path, json.dumps(valid_body(path)).encode(), content_type)
        assert resp.status_code == 415
        assert "application/json" in error_message(resp, path)


def test_bodies_over_the_limit_are_413_before_parsing(server: tuple[str, Path, Path]) -> None:
    url = server[0]
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "a" * LIMIT}]}).encode()
    for method, path in PYDANTIC_ROUTES + RAW_JSON_ROUTES:
        resp = send(url, method, path, big)
        assert resp.status_code == 413
        message = error_message(resp, path)
        assert str(LIMIT) in message and "max_body_bytes" in message
    anthropic = send(url, "POST", "/v1/messages", big)
    assert anthropic.json()["error"]["type"] == "request_too_large"
    openai = send(url, "POST", "/v1/completions", big)
    assert openai.json()["error"]["code"] == "request_too_large"


def test_a_chunked_body_without_length_is_counted_too(server: tuple[str, Path, Path]) -> None:
    url = server[0]

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(LIMIT // 1024 + 1):
            yield b"a" * 1024
        yield b'"}'

    resp = httpx.post(
        url + "/v1/completions",
        content=chunks(),
        headers={**AUTH, "content-type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 413
    # Under the limit, the same route parses and answers.
    small = {"model": MODEL, "prompt": "a" * 100, "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=small, headers=AUTH).status_code == 200


def test_a_body_under_the_limit_is_judged_on_its_content(server: tuple[str, Path, Path]) -> None:
    url = server[0]
    raw = b"{" + b" " * (LIMIT - 2)  # exactly at the limit, and not JSON
    resp = send(url, "POST", "/v1/completions", raw)
    assert resp.status_code == 400


TRAVERSAL_NAMES = [
    f"../{MODEL}",
    "../../../../etc/passwd",
    "/etc/passwd",
    f"{MODEL}/../{MODEL}",
    "..",
    ".",
    f"..\\{MODEL}",
    f"{MODEL}/",
    f"{MODEL}\x00",
    "%2e%2e%2fetc",
    "~/.ssh",
]


def test_traversal_in_model_names_finds_no_model(server: tuple[str, Path, Path]) -> None:
    url = server[0]
    for name in TRAVERSAL_NAMES:
        for method, path in PYDANTIC_ROUTES:
            body = valid_body(path, name)
            resp = send(url, method, path, json.dumps(body).encode())
            assert resp.status_code in (400, 404), (name, path, resp.text)
            error_message(resp, path)


def _raw_request(url: str, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """Through http.client, which sends the path as given (httpx would resolve '..')."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers={**AUTH, "content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_traversal_in_admin_model_paths_is_refused(server: tuple[str, Path, Path]) -> None:
    url, models, _ = server
    escaped = ["..%2F..%2Fetc", "%2e%2e", f"..%2f{MODEL}", "..", "../..", f"../{MODEL}"]
    before = sorted(p.name for p in models.parent.iterdir())
    for name in escaped:
        for method, action in (
            ("GET", "settings"),
            ("PUT", "settings"),
            ("DELETE", "settings"),
            ("POST", "load"),
            ("POST", "unload"),
        ):
            body = b'{"alias": "x"}' if method == "PUT" else b""
            status, text = _raw_request(url, method, f"/admin/api/models/{name}/{action}", body)
            assert status in (400, 404), (name, action, status, text)
    saved = models.parent / "base" / "model_settings.json"
    if saved.exists():
        assert set(json.loads(saved.read_text())) <= {MODEL}
    assert sorted(p.name for p in models.parent.iterdir()) == before


def test_traversal_in_output_names_is_refused(server: tuple[str, Path, Path]) -> None:
    url, models, _ = server
    before = sorted(p.name for p in models.parent.iterdir())
    for name in ["../evil", "../../tmp/evil", "/tmp/evil", ".hidden", "a/b", "..", "a\\..\\b"]:
        body = {"path": str(CORPUS.resolve()), "name": name}
        resp = send(url, "POST", "/admin/api/models/import-gguf", json.dumps(body).encode())
        assert resp.status_code == 400, (name, resp.text)
        assert error_message(resp, "/admin") and resp.json()["error"]["param"] == "name"
    levels = send(url, "GET", "/admin/api/quant/levels").json()["levels"]
    for name in ["../evil", "/tmp/evil", "a/b", ".."]:
        body = {"model": MODEL, "level": levels[0]["name"], "output_name": name}
        resp = send(url, "POST", "/admin/api/quant/tasks", json.dumps(body).encode())
        assert resp.status_code == 400, (name, resp.text)
        assert resp.json()["error"]["param"] == "output_name"
    assert sorted(p.name for p in models.iterdir()) == [MODEL]
    assert sorted(p.name for p in models.parent.iterdir()) == before


@pytest.mark.parametrize(
    "body",
    [
        {**CHAT, "max_tokens": 10**12},
        {**CHAT, "max_tokens": -1},
        {**CHAT, "temperature": "hot"},
        {**CHAT, "messages": []},
        {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
        {**CHAT, "messages": [{"role": "user", "content": "nul \x00 byte"}]},
        {**CHAT, "stop": ["x"] * 10000},
        {**CHAT, "n": 10**6},
        {**CHAT, "logit_bias": {"not-a-token": 5}},
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
    ],
    ids=lambda b: next(iter(set(b) ^ set(CHAT)), "messages"),
)
def test_odd_but_valid_json_never_gets_a_5xx(server: tuple[str, Path, Path], body: dict) -> None:
    url = server[0]
    raw = json.dumps(body).encode()
    resp = send(url, "POST", "/v1/chat/completions", raw)
    assert resp.status_code < 500, resp.text
    if resp.status_code != 200:
        error_message(resp, "/v1/chat/completions")
