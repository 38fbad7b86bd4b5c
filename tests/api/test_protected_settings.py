"""Security settings over the admin API, against a real server and its settings file.

Without a key nobody may change them over HTTP (a hostile page reaching the server
would otherwise open it to the network at the next start); with a key only a
request that sends it (or a login session) may; allow_unauthenticated_remote never.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

KEY = "sk-protected-0123456789"
CLIENT = {"X-Omlx-Client": "test"}
AUTH = {**CLIENT, "Authorization": f"Bearer {KEY}"}

# Each protected setting with a value an attacker would want (and validation accepts).
ATTACKS: dict[str, Any] = {
    "server.host": "0.0.0.0",
    "server.allow_unauthenticated_remote": True,
    "server.api_key": "sk-attacker",
    "server.web_dir": "/tmp/evil-panel",
    "server.cors_origins": ["http://evil.example"],
    "server.allowed_hosts": ["evil.example"],
    "models.model_dirs": ["/tmp"],
    "models.hf_endpoint": "http://evil.example",  # would receive models.hf_token
    "models.image_url_allowlist": ["*"],  # the server would fetch any URL a page names
    "cache.ssd_cache_dir": "/tmp/evil-cache",
    "app.update_feed": "http://evil.example/omlx-update.json",  # the app would install it
}


def nested(key: str, value: Any) -> dict[str, Any]:
    group, field = key.split(".")
    return {group: {field: value}}


def start(base: Path, models: Path, **groups: Any):
    # A settings file the user wrote before: it must come out byte-identical.
    base.mkdir(parents=True, exist_ok=True)
    (base / "settings.json").write_text('{"sampling": {"top_k": 5}}\n', encoding="utf-8")
    return live_server(base, models, cache={"enabled": False}, **groups)


@pytest.fixture(scope="module")
def open_server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    with start(tmp_path_factory.mktemp("open-base"), tiny_models_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("keyed-base")
    with start(base, tiny_models_dir, server={"api_key": KEY}) as srv:
        yield srv


def put_settings(server: Server, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    return httpx.put(server.base_url + "/admin/api/settings", json=body, headers=headers)


# -- no key set ----------------------------------------------------------------------


@pytest.mark.parametrize("key", list(ATTACKS))
def test_without_a_key_every_protected_setting_is_refused(open_server: Server, key: str) -> None:
    before = open_server.settings.settings_path.read_bytes()
    running = open_server.settings.model_dump(mode="json")
    refused = put_settings(open_server, nested(key, ATTACKS[key]), CLIENT)
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == "protected_setting"
    assert error["param"] == key
    assert f"'{key}'" in error["message"]
    assert f"omlx config set {key}" in error["message"]
    assert str(open_server.settings.settings_path) in error["message"]
    assert open_server.settings.settings_path.read_bytes() == before
    assert open_server.settings.model_dump(mode="json") == running


def test_a_refused_key_means_nothing_of_the_body_is_written(open_server: Server) -> None:
    before = open_server.settings.settings_path.read_bytes()
    mixed = {"sampling": {"temperature": 0.3}, "server": {"host": "0.0.0.0"}}
    refused = put_settings(open_server, mixed, CLIENT)
    assert refused.status_code == 403 and "'server.host'" in refused.json()["error"]["message"]
    assert open_server.settings.settings_path.read_bytes() == before
    assert open_server.settings.sampling.temperature == pytest.approx(1.0)


def test_without_a_key_normal_settings_still_change_live(open_server: Server) -> None:
    saved = put_settings(open_server, {"sampling": {"temperature": 0.4}}, CLIENT)
    assert saved.status_code == 200, saved.text
    try:
        assert saved.json()["applied"] == ["sampling.temperature"]
        assert open_server.settings.sampling.temperature == pytest.approx(0.4)
        on_disk = json.loads(open_server.settings.settings_path.read_text(encoding="utf-8"))
        assert on_disk == {"sampling": {"top_k": 5, "temperature": 0.4}}
    finally:
        put_settings(open_server, {"sampling": {"temperature": 1.0}}, CLIENT)


def test_settings_say_which_fields_are_read_only_and_why(open_server: Server) -> None:
    got = httpx.get(open_server.base_url + "/admin/api/settings").json()
    assert set(got["protected"]) == set(ATTACKS)
    assert got["can_change_protected"] is False
    assert set(got["locked"]) == set(ATTACKS)
    assert "omlx config set server.host" in got["locked"]["server.host"]
    assert "API key and login" in got["locked"]["server.host"]


def test_a_model_setting_cannot_bring_its_own_template(open_server: Server) -> None:
    """Per-model settings hold no paths; the one way to carry code, a chat_template in
    chat_template_kwargs, is refused (it would run on every request to the model)."""
    path = open_server.settings.model_settings_path
    before = path.read_bytes() if path.exists() else None
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    refused = httpx.put(
        open_server.base_url + "/admin/api/models/tiny-llama/settings",
        json={"chat_template_kwargs": {"chat_template": bomb}},
        headers=CLIENT,
    )
    assert refused.status_code == 400
    assert "chat_template" in refused.json()["error"]["message"]
    assert (path.read_bytes() if path.exists() else None) == before


# -- a key set -------------------------------------------------------------------------


def test_with_the_key_in_a_header_protected_settings_are_saved(keyed_server: Server) -> None:
    body = {"server": {"host": "0.0.0.0"}, "models": {"model_dirs": ["/srv/models"]}}
    saved = put_settings(keyed_server, body, AUTH)
    assert saved.status_code == 200, saved.text
    assert saved.json()["restart_required"] == ["models.model_dirs", "server.host"]
    on_disk = json.loads(keyed_server.settings.settings_path.read_text(encoding="utf-8"))
    assert on_disk["server"]["host"] == "0.0.0.0"
    assert on_disk["models"]["model_dirs"] == ["/srv/models"]


def test_with_a_login_session_protected_settings_are_saved(keyed_server: Server) -> None:
    with httpx.Client(base_url=keyed_server.base_url, headers=CLIENT) as browser:
        assert browser.post("/admin/api/login", json={"api_key": KEY}).status_code == 200
        got = browser.get("/admin/api/settings").json()
        assert got["can_change_protected"] is True
        assert list(got["locked"]) == ["server.allow_unauthenticated_remote"]
        saved = browser.put(
            "/admin/api/settings", json=nested("server.allowed_hosts", ["omlx.lan"])
        )
        assert saved.status_code == 200, saved.text
    on_disk = json.loads(keyed_server.settings.settings_path.read_text(encoding="utf-8"))
    assert on_disk["server"]["allowed_hosts"] == ["omlx.lan"]


def test_the_key_itself_changes_live_with_the_key(keyed_server: Server) -> None:
    rotated = {**CLIENT, "Authorization": "Bearer sk-rotated-0123456789"}
    changed = put_settings(keyed_server, nested("server.api_key", "sk-rotated-0123456789"), AUTH)
    assert changed.status_code == 200 and changed.json()["applied"] == ["server.api_key"]
    try:
        models = keyed_server.base_url + "/admin/api/models"
        assert httpx.get(models, headers=AUTH).status_code == 401
        assert httpx.get(models, headers=rotated).status_code == 200
    finally:
        assert put_settings(keyed_server, nested("server.api_key", KEY), rotated).status_code == 200


def test_allow_unauthenticated_remote_is_refused_even_with_the_key(keyed_server: Server) -> None:
    before = keyed_server.settings.settings_path.read_bytes()
    body = {"server": {"allow_unauthenticated_remote": True}, "sampling": {"top_p": 0.5}}
    refused = put_settings(keyed_server, body, AUTH)
    assert refused.status_code == 403
    message = refused.json()["error"]["message"]
    assert "'server.allow_unauthenticated_remote'" in message and "even with the API key" in message
    assert "omlx config set server.allow_unauthenticated_remote" in message
    assert keyed_server.settings.settings_path.read_bytes() == before
    assert keyed_server.settings.server.allow_unauthenticated_remote is False


@pytest.mark.parametrize("headers", [CLIENT, {**CLIENT, "x-api-key": "sk-guess"}])
def test_with_a_key_an_unauthenticated_mixed_body_writes_nothing(
    keyed_server: Server, headers: dict[str, str]
) -> None:
    before = keyed_server.settings.settings_path.read_bytes()
    mixed = {"sampling": {"temperature": 0.2}, "server": {"cors_origins": ["http://evil.example"]}}
    assert put_settings(keyed_server, mixed, headers).status_code == 401
    assert keyed_server.settings.settings_path.read_bytes() == before
    assert keyed_server.settings.sampling.temperature == pytest.approx(1.0)
