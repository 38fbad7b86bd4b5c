"""API keys on every route group, the admin API, and per-model settings applied
live, against a real server (official clients where a client exists)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("admin-base"),
        tiny_models_dir,
        server={"api_key": KEY},
        cache={"enabled": False},
        profiles=profiles_dir,
    ) as srv:
        yield srv


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/messages", {**CHAT, "max_tokens": 2}),
    ("POST", "/v1/messages/count_tokens", {"model": "tiny-llama", "messages": CHAT["messages"]}),
    ("GET", "/admin/api/models", None),
    ("GET", "/admin/api/status", None),
    ("GET", "/admin/api/settings", None),
    ("GET", "/admin/api/cache/stats", None),
    ("GET", "/admin/api/memory", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_route_needs_the_key(http: httpx.Client, method: str, path: str, body) -> None:
    refused = http.request(method, path, json=body)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"].startswith("Bearer")
    wrong = http.request(method, path, json=body, headers={"x-api-key": "sk-wrong"})
    assert wrong.status_code == 401
    if path.startswith("/v1/messages"):
        assert refused.json()["error"]["type"] == "authentication_error"
        assert refused.json()["type"] == "error"
    else:
        assert refused.json()["error"]["type"] == "authentication_error"
    assert http.request(method, path, json=body, headers=AUTH).status_code == 200
    assert http.request(method, path, json=body, headers={"x-api-key": KEY}).status_code == 200


def test_health_stays_open(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200


def test_official_clients_send_the_key(server: Server) -> None:
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    assert oai.chat.completions.create(**CHAT).choices[0].message.role == "assistant"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="bad", max_retries=0).models.list()
    claude = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert claude.messages.create(**CHAT).role == "assistant"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="bad", max_retries=0).messages.create(
            **CHAT
        )


def test_admin_login_session(server: Server) -> None:
    with httpx.Client(base_url=server.base_url) as browser:
        assert browser.post("/admin/api/login", json={"api_key": "nope"}).status_code == 401
        assert browser.get("/admin/api/models").status_code == 401
        assert browser.post("/admin/api/login", json={"api_key": KEY}).status_code == 200
        assert browser.get("/admin/api/models").status_code == 200
        # The panel's chat uses /v1 with the same httpOnly session (no key in the page).
        assert browser.get("/v1/models").status_code == 200
        token = browser.cookies.get("omlx_session")
        assert token and KEY not in token
        # The session token is not a key: sent as one it is refused.
        refused = httpx.get(
            server.base_url + "/v1/models", headers={"Authorization": f"Bearer {token}"}
        )
        assert refused.status_code == 401
        # As the panel does: a cookie-authorized change carries the client header.
        browser.post("/admin/api/logout", headers={"X-Omlx-Client": "admin"})
        assert browser.get("/admin/api/models").status_code == 401
        assert browser.get("/v1/models").status_code == 401


def test_the_key_never_reaches_the_log(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    settings = httpx.get(server.base_url + "/admin/api/settings", headers=AUTH).json()
    assert settings["settings"]["server"]["api_key"] == "***"
    assert KEY not in json.dumps(settings)
    log_file = server.settings.log_dir / "server.log"
    if log_file.exists():
        assert KEY not in log_file.read_text()
    assert all(KEY not in r.getMessage() for r in caplog.records if r.levelno >= logging.DEBUG)


def test_load_unload_and_states(http: httpx.Client) -> None:
    r = http.post("/admin/api/models/tiny-qwen3/load", headers=AUTH)
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    models = {m["name"]: m for m in http.get("/admin/api/models", headers=AUTH).json()["models"]}
    assert models["tiny-qwen3"]["state"] == "loaded"
    assert models["tiny-qwen3"]["memory_bytes"] > 0
    assert models["slow-llama"]["state"] == "unloaded"
    r = http.post("/admin/api/models/tiny-qwen3/unload", headers=AUTH)
    assert r.json() == {"name": "tiny-qwen3", "unloaded": True, "state": "unloaded"}
    missing = http.post("/admin/api/models/nope/load", headers=AUTH)
    assert missing.status_code == 404 and "tiny-llama" in missing.json()["error"]["message"]


def test_model_settings_alias_and_validation(server: Server, http: httpx.Client) -> None:
    path = "/admin/api/models/tiny-llama/settings"
    bad = http.put(path, json={"temperature": 9}, headers=AUTH)
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    unknown = http.put(path, json={"colour": "red"}, headers=AUTH)
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["message"]
    clash = http.put(path, json={"alias": "tiny-qwen3"}, headers=AUTH)
    assert clash.status_code == 400
    ok = http.put(path, json={"alias": "small-llama"}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["settings"]["alias"] == "small-llama"
    try:
        oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
        ids = {m.id for m in oai.models.list().data}
        assert "small-llama" in ids and "tiny-llama" not in ids
        reply = oai.chat.completions.create(**{**CHAT, "model": "small-llama"})
        assert reply.model == "small-llama"
        # The folder name keeps working.
        assert oai.chat.completions.create(**CHAT).model == "small-llama"
        saved = json.loads(server.settings.model_settings_path.read_text())
        assert saved["tiny-llama"]["alias"] == "small-llama"
    finally:
        assert http.delete(path, headers=AUTH).status_code == 200
    assert http.get(path, headers=AUTH).json()["settings"]["alias"] is None


def test_model_sampling_settings_apply_live_and_force(server: Server, http: httpx.Client) -> None:
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    prompt = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 16}
    greedy = oai.completions.create(**prompt, temperature=0).choices[0].text
    hot = [
        oai.completions.create(**prompt, temperature=2.0, seed=s).choices[0].text for s in (1, 2)
    ]
    assert any(t != greedy for t in hot)  # a hot request really samples
    path = "/admin/api/models/tiny-llama/settings"
    try:
        http.put(path, json={"temperature": 0.0}, headers=AUTH)
        # Model default applies when the request says nothing ...
        assert oai.completions.create(**prompt).choices[0].text == greedy
        # ... the request wins otherwise ...
        assert oai.completions.create(**prompt, temperature=2.0, seed=1).choices[0].text == hot[0]
        # ... unless the model forces its sampling.
        http.put(path, json={"force_sampling": True}, headers=AUTH)
        forced = oai.completions.create(**prompt, temperature=2.0, seed=1).choices[0].text
        assert forced == greedy
    finally:
        http.delete(path, headers=AUTH)


def test_global_settings_live_and_restart(server: Server, http: httpx.Client) -> None:
    got = http.get("/admin/api/settings", headers=AUTH).json()
    assert "sampling.temperature" in got["live"]
    bad = http.put("/admin/api/settings", json={"sampling": {"temperature": -1}}, headers=AUTH)
    assert bad.status_code == 400 and "sampling.temperature" in bad.json()["error"]["message"]
    r = http.put(
        "/admin/api/settings",
        json={"generation": {"max_tokens": 3}, "scheduler": {"max_concurrent_requests": 4}},
        headers=AUTH,
    )
    assert r.status_code == 200
    assert r.json()["applied"] == ["generation.max_tokens"]
    assert r.json()["restart_required"] == ["scheduler.max_concurrent_requests"]
    try:
        reply = http.post(
            "/v1/completions",
            json={"model": "tiny-llama", "prompt": "hi", "ignore_eos": True},
            headers=AUTH,
        ).json()
        assert reply["usage"]["completion_tokens"] == 3  # applied without a restart
        saved = json.loads(server.settings.settings_path.read_text())
        assert saved["scheduler"]["max_concurrent_requests"] == 4
    finally:
        http.put("/admin/api/settings", json={"generation": {"max_tokens": 4096}}, headers=AUTH)


def test_cache_and_memory_endpoints(http: httpx.Client) -> None:
    stats = http.get("/admin/api/cache/stats", headers=AUTH).json()
    assert stats["enabled"] is False
    assert http.post("/admin/api/cache/clear", json={}, headers=AUTH).status_code == 404
    memory = http.get("/admin/api/memory", headers=AUTH).json()
    assert memory["limit_bytes"] >= memory["soft_limit_bytes"] > 0
    health = http.get("/health").json()["memory"]
    # MLX's CPU backend has no Metal working set: the term is there, and null.
    assert health["metal_cap_bytes"] is None and health["limit_bytes"] == memory["limit_bytes"]


def test_ten_wrong_logins_then_even_the_right_key_gets_429(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    """Guessing the key through the login form is limited per client (its own server:
    the lock-out would otherwise leak into the other tests' logins)."""
    with (
        live_server(
            tmp_path, tiny_models_dir, server={"api_key": KEY}, profiles=profiles_dir
        ) as srv,
        httpx.Client(base_url=srv.base_url, headers={"X-Omlx-Client": "test"}) as browser,
    ):
        for n in range(10):
            wrong = browser.post("/admin/api/login", json={"api_key": f"sk-guess-{n}"})
            assert wrong.status_code == 401
        limited = browser.post("/admin/api/login", json={"api_key": KEY})
        assert limited.status_code == 429
        assert 1 <= int(limited.headers["retry-after"]) <= 60
        assert limited.json()["error"]["type"] == "rate_limit_error"
        assert "omlx_session" not in browser.cookies
        assert browser.get("/admin/api/models").status_code == 401
        # The key itself keeps working in a header: only guessing logins is held up.
        assert browser.get("/admin/api/models", headers=AUTH).status_code == 200
