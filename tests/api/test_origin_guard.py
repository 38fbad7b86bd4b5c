"""The HTTP edge against web pages, attacked over raw HTTP the way a page (or a
rebinding DNS name) would reach a real server: foreign Host headers, cross-site
origins, form and text/plain bodies, body-less POSTs and the login cookie alone.
The browser-driven versions are in tests/e2e/test_attacks.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server, serve_process

KEY = "sk-origin-guard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CLIENT = {"X-Omlx-Client": "admin"}
LISTED_SITE = "http://app.example:3000"
PROXY_NAME = "omlx.lan"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("guard-base"),
        tiny_models_dir,
        server={"api_key": KEY, "allowed_hosts": [PROXY_NAME], "cors_origins": [LISTED_SITE]},
        cache={"enabled": False},
        profiles=profiles_dir,
    ) as srv:
        yield srv


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def raw_request(server: Server, head: str) -> tuple[int, bytes]:
    """Send ``head`` (request line and headers) byte for byte: no client fills in Host."""
    with socket.create_connection(("127.0.0.1", server.settings.server.port), timeout=30) as s:
        s.sendall(head.encode("latin-1") + b"\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def error(resp: httpx.Response) -> dict:
    return resp.json()["error"]


# -- Host: DNS rebinding -----------------------------------------------------------


@pytest.mark.parametrize("path", ["/admin/api/settings", "/admin/", "/v1/models", "/health"])
def test_a_foreign_host_is_refused_naming_the_setting(http: httpx.Client, path: str) -> None:
    port = http.base_url.port
    # What a rebinding page's requests carry: its own name, with the key (worst case).
    resp = http.get(path, headers={**AUTH, "Host": f"evil.example:{port}"})
    assert resp.status_code == 403
    assert error(resp)["code"] == "host_not_allowed"
    assert "server.allowed_hosts" in error(resp)["message"]
    assert "evil.example" in error(resp)["message"]


def test_a_foreign_host_cannot_change_anything(http: httpx.Client, server: Server) -> None:
    before = (
        server.settings.settings_path.read_bytes()
        if server.settings.settings_path.exists()
        else None
    )
    resp = http.put(
        "/admin/api/settings",
        json={"sampling": {"temperature": 0.1}},
        headers={**AUTH, **CLIENT, "Host": "evil.example"},
    )
    assert resp.status_code == 403
    after = (
        server.settings.settings_path.read_bytes()
        if server.settings.settings_path.exists()
        else None
    )
    assert after == before


@pytest.mark.parametrize(
    "host",
    ["localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "app.localhost:{port}", "LOCALHOST"],
)
def test_loopback_names_are_served(http: httpx.Client, host: str) -> None:
    resp = http.get(
        "/admin/api/status", headers={**AUTH, "Host": host.format(port=http.base_url.port)}
    )
    assert resp.status_code == 200, resp.text


def test_allowed_hosts_admits_a_listed_name(http: httpx.Client) -> None:
    port = http.base_url.port
    assert http.get("/health", headers={"Host": f"{PROXY_NAME}:{port}"}).status_code == 200
    # Only that name: a look-alike is still someone else.
    assert http.get("/health", headers={"Host": f"x.{PROXY_NAME}:{port}"}).status_code == 403


def test_the_allowed_host_flag_admits_a_name(tmp_path: Path, tiny_models_dir: Path) -> None:
    with serve_process(tmp_path / "base", tiny_models_dir, "--allowed-host", "omlx.lan") as (
        _,
        url,
    ):
        port = httpx.URL(url).port
        listed = httpx.get(url + "/health", headers={"Host": f"omlx.lan:{port}"})
        other = httpx.get(url + "/health", headers={"Host": f"evil.example:{port}"})
    assert listed.status_code == 200
    assert other.status_code == 403


@pytest.mark.parametrize(
    "head",
    [
        "GET /health HTTP/1.0\r\n",  # no Host at all
        "GET /health HTTP/1.1\r\nHost: \r\nConnection: close\r\n",  # an empty Host
        "GET /health HTTP/1.1\r\nHost: user@127.0.0.1\r\nConnection: close\r\n",
    ],
    ids=["missing", "empty", "userinfo"],
)
def test_a_missing_or_empty_host_is_refused(server: Server, head: str) -> None:
    status, body = raw_request(server, head)
    assert status == 403, body
    assert b"host_not_allowed" in body


# -- cross-site requests -------------------------------------------------------------


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1"])
def test_a_foreign_origin_cannot_change_state(http: httpx.Client, origin: str) -> None:
    # Even with the key and the client header: the Origin alone decides.
    resp = http.post(
        "/admin/api/models/tiny-llama/load", headers={**AUTH, **CLIENT, "Origin": origin}
    )
    assert resp.status_code == 403
    assert error(resp)["code"] == "cross_site_request"
    assert "server.cors_origins" in error(resp)["message"]
    assert "tiny-llama" not in {m["name"] for m in http.get("/health").json()["loaded_models"]}


def test_sec_fetch_site_cross_site_is_refused(http: httpx.Client) -> None:
    resp = http.post(
        "/admin/api/memory/preview", json={}, headers={**AUTH, "Sec-Fetch-Site": "cross-site"}
    )
    assert resp.status_code == 403
    assert error(resp)["code"] == "cross_site_request"


def test_the_servers_own_origin_may_change_state(http: httpx.Client) -> None:
    own = str(http.base_url).rstrip("/")
    headers = {**AUTH, "Origin": own, "Sec-Fetch-Site": "same-origin"}
    assert http.post("/admin/api/memory/preview", json={}, headers=headers).status_code == 200


def test_a_listed_cors_origin_may_call_v1_only(http: httpx.Client) -> None:
    site = {"Origin": LISTED_SITE, "Sec-Fetch-Site": "cross-site"}
    chat = http.post("/v1/chat/completions", json=CHAT, headers={**AUTH, **site})
    assert chat.status_code == 200, chat.text
    assert chat.headers["access-control-allow-origin"] == LISTED_SITE
    # The same site may not touch the admin API: CORS is for /v1 only.
    admin = http.post("/admin/api/memory/preview", json={}, headers={**AUTH, **site})
    assert admin.status_code == 403
    preflight = http.options(
        "/admin/api/settings",
        headers={"Origin": LISTED_SITE, "Access-Control-Request-Method": "PUT"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    v1_preflight = http.options(
        "/v1/chat/completions",
        headers={"Origin": LISTED_SITE, "Access-Control-Request-Method": "POST"},
    )
    assert v1_preflight.headers["access-control-allow-origin"] == LISTED_SITE


def test_a_wildcard_cors_origin_opens_v1_to_every_site_but_not_admin(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    with live_server(
        tmp_path,
        tiny_models_dir,
        server={"api_key": KEY, "cors_origins": ["*"]},
        profiles=profiles_dir,
    ) as srv:
        site = {"Origin": "https://any.example", "Sec-Fetch-Site": "cross-site"}
        with httpx.Client(base_url=srv.base_url, timeout=60) as http:
            chat = http.post("/v1/chat/completions", json=CHAT, headers={**AUTH, **site})
            assert chat.status_code == 200, chat.text
            assert chat.headers["access-control-allow-origin"] == "*"
            admin = http.post("/admin/api/memory/preview", json={}, headers={**AUTH, **site})
            assert admin.status_code == 403
            # The key cannot go while every site may call: that is what it protects.
            drop = http.put("/admin/api/settings", json={"server": {"api_key": None}}, headers=AUTH)
            assert drop.status_code == 400 and "cors_origins" in error(drop)["message"]
            assert http.get("/v1/models").status_code == 401


# -- bodies a web page can send ----------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ],
)
def test_a_form_or_text_body_is_415(http: httpx.Client, content_type: str) -> None:
    resp = http.post(
        "/admin/api/cache/clear",
        content=b'{"tier": "both"}',
        headers={**AUTH, "Content-Type": content_type},
    )
    assert resp.status_code == 415
    assert "Content-Type: application/json" in error(resp)["message"]


def test_a_bodyless_post_needs_json_or_the_client_header(
    http: httpx.Client, server: Server
) -> None:
    # What a <form> with no fields or a bare no-cors fetch sends, here with a session.
    http.post("/admin/api/login", json={"api_key": KEY})
    bare = http.post("/admin/api/models/tiny-llama/load")
    assert bare.status_code == 415
    assert "X-Omlx-Client" in error(bare)["message"]
    loaded = http.post("/admin/api/models/tiny-llama/load", headers=CLIENT)
    assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"
    as_json = http.post(
        "/admin/api/models/tiny-llama/unload",
        headers={**CLIENT, "Content-Type": "application/json"},
    )
    assert as_json.status_code == 200 and as_json.json()["unloaded"] is True
    # A script with the key needs nothing more: no page can add that header unasked.
    with httpx.Client(base_url=server.base_url, timeout=60) as script:
        assert script.post("/admin/api/models/tiny-llama/load", headers=AUTH).status_code == 200
        assert script.post("/admin/api/models/tiny-llama/unload", headers=AUTH).status_code == 200


def test_the_login_cookie_alone_cannot_change_state(server: Server) -> None:
    """Cookies ignore ports: a page on another localhost port carries the session.
    Only the panel's header (which needs a preflight cross-origin) makes it count."""
    with httpx.Client(base_url=server.base_url, timeout=60) as browser:
        assert browser.post("/admin/api/login", json={"api_key": KEY}).status_code == 200
        assert browser.get("/admin/api/status").status_code == 200  # reading is fine
        change = {"sampling": {"top_k": 7}}
        refused = browser.put("/admin/api/settings", json=change)
        assert refused.status_code == 403
        assert error(refused)["code"] == "client_header_required"
        assert server.settings.sampling.top_k != 7
        accepted = browser.put("/admin/api/settings", json=change, headers=CLIENT)
        assert accepted.status_code == 200, accepted.text
        assert server.settings.sampling.top_k == 7


# -- headers, docs -------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/admin/", "/admin/js/app.js", "/admin/api/status"])
def test_the_panel_is_sent_with_security_headers(http: httpx.Client, path: str) -> None:
    resp = http.get(path, headers=AUTH)
    assert resp.status_code == 200
    csp = resp.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert resp.headers["x-frame-options"] == "DENY"
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert resp.headers["referrer-policy"] == "no-referrer"


def test_docs_are_off_and_the_schema_needs_the_key(http: httpx.Client) -> None:
    assert http.get("/docs").status_code == 404
    assert http.get("/redoc").status_code == 404
    assert http.get("/openapi.json").status_code == 401
    schema = http.get("/openapi.json", headers=AUTH)
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]


# -- bound beyond loopback ---------------------------------------------------------


def _an_interface_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for addr in addresses:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return addr.address
    return None


def test_bound_to_all_interfaces_the_machines_names_are_served(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    with live_server(
        tmp_path, tiny_models_dir, server={"host": "0.0.0.0", "api_key": KEY}, profiles=profiles_dir
    ) as srv:
        url = f"http://127.0.0.1:{srv.settings.server.port}"
        port = srv.settings.server.port
        names = [socket.gethostname(), f"127.0.0.1:{port}", f"localhost:{port}"]
        address = _an_interface_address()
        if address:
            names.append(f"{address}:{port}")
        for name in names:
            assert httpx.get(url + "/health", headers={"Host": name}).status_code == 200, name
        for foreign in ("evil.example", f"0.0.0.0:{port}", "10.255.255.254"):
            assert httpx.get(url + "/health", headers={"Host": foreign}).status_code == 403, foreign
