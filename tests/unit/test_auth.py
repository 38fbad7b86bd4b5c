"""Optional API key (omlx.api.auth): header checks, admin sessions, bind check, redaction."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from omlx.api.auth import (
    SESSION_COOKIE,
    ApiKeyAuth,
    RedactKeyFilter,
    check_bind,
    login_router,
    require_admin,
    require_api_key,
)
from omlx.api.errors import install_error_handlers
from omlx.errors import AuthenticationError, RateLimitedError, SettingsError

KEY = "sk-test-0123456789"
TTL_S = 3600.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A minimal app wired as the server wires it; the key and clock are mutable."""

    def __init__(self, key: str | None, session_ttl_s: float = TTL_S, **auth_options: float):
        self.key = key
        self.clock = FakeClock()
        app = FastAPI()
        self.auth = ApiKeyAuth(
            lambda: self.key, session_ttl_s=session_ttl_s, clock=self.clock, **auth_options
        )
        app.state.auth = self.auth
        install_error_handlers(app)
        app.include_router(login_router())

        @app.get("/v1/models", dependencies=[Depends(require_api_key)])
        async def models() -> dict[str, str]:
            return {"object": "list"}

        @app.get("/admin/api/settings", dependencies=[Depends(require_admin)])
        async def settings() -> dict[str, str]:
            return {"admin": "yes"}

        self.client = TestClient(app)

    def login(self, key: str = KEY) -> str:
        resp = self.client.post("/admin/api/login", json={"api_key": key})
        assert resp.status_code == 200, resp.text
        return resp.cookies[SESSION_COOKIE]


@pytest.fixture
def open_server() -> Harness:
    return Harness(key=None)


@pytest.fixture
def server() -> Harness:
    return Harness(key=KEY)


def assert_auth_error(resp_status: int, body: dict[str, object]) -> None:
    assert resp_status == 401
    error = body["error"]
    assert isinstance(error, dict)
    assert error["type"] == "authentication_error"
    assert KEY not in str(body)


# --- no key: everything open -------------------------------------------------


@pytest.mark.parametrize("key", [None, ""])
def test_no_key_leaves_everything_open(key: str | None) -> None:
    h = Harness(key=key)
    assert not h.auth.enabled
    assert h.client.get("/v1/models").status_code == 200
    assert h.client.get("/admin/api/settings").status_code == 200
    assert h.client.get("/v1/models", headers={"x-api-key": "anything"}).status_code == 200


def test_login_without_a_key_set_is_ok_and_sets_no_cookie(open_server: Harness) -> None:
    resp = open_server.client.post("/admin/api/login", json={"api_key": "x"})
    assert resp.status_code == 200
    assert resp.json() == {"ok": True}
    assert SESSION_COOKIE not in resp.cookies


# --- API routes ----------------------------------------------------------------


def test_api_route_without_key_is_401_with_openai_envelope(server: Harness) -> None:
    resp = server.client.get("/v1/models")
    assert_auth_error(resp.status_code, resp.json())
    error = resp.json()["error"]
    assert error["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in error["message"]
    assert "x-api-key" in error["message"]


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer wrong-key"},
        {"x-api-key": "wrong-key"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"x-api-key": KEY[:-1]},
    ],
)
def test_api_route_with_wrong_key_is_401(server: Harness, headers: dict[str, str]) -> None:
    resp = server.client.get("/v1/models", headers=headers)
    assert_auth_error(resp.status_code, resp.json())
    assert "wrong-key" not in resp.text


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {KEY}"},
        {"Authorization": f"bearer {KEY}"},
        {"x-api-key": KEY},
    ],
)
def test_api_route_with_right_key_is_200(server: Harness, headers: dict[str, str]) -> None:
    resp = server.client.get("/v1/models", headers=headers)
    assert resp.status_code == 200
    assert resp.json() == {"object": "list"}


def test_session_cookie_opens_api_routes_until_logout(server: Harness) -> None:
    """The admin panel's chat calls /v1 with its httpOnly login session."""
    assert server.client.get("/v1/models").status_code == 401
    server.login()
    assert server.client.get("/v1/models").status_code == 200
    server.client.post("/admin/api/logout")
    assert server.client.get("/v1/models").status_code == 401


def test_key_change_applies_at_once(server: Harness) -> None:
    server.key = "sk-new"
    assert server.client.get("/v1/models", headers={"x-api-key": KEY}).status_code == 401
    assert server.client.get("/v1/models", headers={"x-api-key": "sk-new"}).status_code == 200


# --- admin routes and sessions -----------------------------------------------------


def test_admin_route_needs_key_or_session(server: Harness) -> None:
    resp = server.client.get("/admin/api/settings")
    assert_auth_error(resp.status_code, resp.json())
    ok = server.client.get("/admin/api/settings", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert ok.json() == {"admin": "yes"}


def test_login_with_wrong_key_is_401_and_sets_no_cookie(server: Harness) -> None:
    resp = server.client.post("/admin/api/login", json={"api_key": "wrong"})
    assert_auth_error(resp.status_code, resp.json())
    assert SESSION_COOKIE not in resp.cookies
    assert server.client.get("/admin/api/settings").status_code == 401


@pytest.mark.parametrize(
    "content",
    [b"not json", b"[1, 2]", b"{}", b'{"api_key": 5}', b'{"api_key": ""}'],
)
def test_login_with_bad_body_is_400(server: Harness, content: bytes) -> None:
    resp = server.client.post(
        "/admin/api/login", content=content, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_login_sets_a_strict_http_only_cookie_that_opens_admin(server: Harness) -> None:
    resp = server.client.post("/admin/api/login", json={"api_key": KEY})
    assert resp.status_code == 200
    assert resp.json() == {"ok": True}
    set_cookie = resp.headers["set-cookie"]
    assert set_cookie.startswith(f"{SESSION_COOKIE}=")
    lowered = set_cookie.lower()
    assert "httponly" in lowered
    assert "samesite=strict" in lowered
    assert "path=/" in lowered
    assert f"max-age={int(TTL_S)}" in lowered
    assert KEY not in set_cookie
    # The client now holds only the cookie: no key header is sent.
    assert server.client.get("/admin/api/settings").status_code == 200


def test_forged_cookie_is_rejected(server: Harness) -> None:
    server.client.cookies.set(SESSION_COOKIE, "forged-token")
    assert server.client.get("/admin/api/settings").status_code == 401


def test_logout_invalidates_the_session(server: Harness) -> None:
    token = server.login()
    resp = server.client.post("/admin/api/logout")
    assert resp.status_code == 200
    assert SESSION_COOKIE not in server.client.cookies
    assert server.client.get("/admin/api/settings").status_code == 401
    # Replaying the old token fails too: the server forgot it, not just the browser.
    server.client.cookies.set(SESSION_COOKIE, token)
    assert server.client.get("/admin/api/settings").status_code == 401


def test_session_expires(server: Harness) -> None:
    server.login()
    server.clock.now += TTL_S - 1
    assert server.client.get("/admin/api/settings").status_code == 200
    server.clock.now += 2
    assert server.client.get("/admin/api/settings").status_code == 401


def test_changing_the_key_invalidates_sessions(server: Harness) -> None:
    server.login()
    server.key = "sk-rotated"
    assert server.client.get("/admin/api/settings").status_code == 401
    server.login("sk-rotated")
    assert server.client.get("/admin/api/settings").status_code == 200


def test_login_tokens_are_distinct() -> None:
    auth = ApiKeyAuth(lambda: KEY)
    tokens = {auth.login(KEY) for _ in range(5)}
    assert len(tokens) == 5
    assert all(len(t) >= 40 for t in tokens)


def test_login_rejects_wrong_key_directly() -> None:
    auth = ApiKeyAuth(lambda: KEY)
    with pytest.raises(AuthenticationError):
        auth.login("wrong")
    with pytest.raises(AuthenticationError):
        ApiKeyAuth(lambda: None).login("")


def opens_admin(h: Harness, token: str) -> bool:
    """Whether ``token`` alone (as the browser's cookie) opens the admin API."""
    h.client.cookies.clear()
    h.client.cookies.set(SESSION_COOKIE, token)
    return h.client.get("/admin/api/settings").status_code == 200


def test_idle_session_expires_but_a_used_one_lives_to_its_ttl() -> None:
    week_s, hour_s = 7 * 24 * 3600.0, 3600.0
    h = Harness(key=KEY, session_ttl_s=week_s, session_idle_s=12 * hour_s)
    used, idle = h.login(), h.login()
    started = h.clock.now
    # Used every 11 h, a session outlives the 12 h idle limit ...
    for _ in range(15):
        h.clock.now += 11 * hour_s
        assert opens_admin(h, used)
    # ... while one left alone for 12 h is gone, and stays gone.
    assert not opens_admin(h, idle)
    # The absolute TTL (7 days) still ends the used one.
    h.clock.now += 11 * hour_s
    assert h.clock.now - started > week_s
    assert not opens_admin(h, used)
    assert h.auth.session_count() == 0


def test_session_table_is_bounded_dropping_the_least_recently_used(server: Harness) -> None:
    auth = server.auth
    first, second = server.login(), server.login()
    server.clock.now += 1
    assert opens_admin(server, first)  # used just now: the next to go is `second`
    others = []
    for _ in range(auth.max_sessions - 2):
        server.clock.now += 1
        others.append(server.login())
    assert auth.session_count() == auth.max_sessions == 64
    newest = server.login()
    assert auth.session_count() == 64
    assert not opens_admin(server, second)
    assert opens_admin(server, first)
    assert opens_admin(server, newest) and opens_admin(server, others[0])


def failed_login(h: Harness, key: str = "sk-guess"):
    return h.client.post("/admin/api/login", json={"api_key": key})


def test_ten_failed_logins_then_429_with_retry_after_even_for_the_right_key(
    server: Harness,
) -> None:
    for _ in range(10):
        assert failed_login(server).status_code == 401
        server.clock.now += 1
    refused = failed_login(server, KEY)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "too many failed logins" in refused.json()["error"]["message"]
    # The oldest failure (10 s ago) leaves the 60 s window in 50 s.
    assert refused.headers["retry-after"] == "50"
    assert SESSION_COOKIE not in refused.cookies
    server.clock.now += 50
    assert server.client.post("/admin/api/login", json={"api_key": KEY}).status_code == 200


def test_the_right_key_within_the_limit_still_logs_in(server: Harness) -> None:
    for _ in range(9):
        assert failed_login(server).status_code == 401
    server.login()
    assert server.client.get("/admin/api/settings").status_code == 200


def test_the_window_slides(server: Harness) -> None:
    for _ in range(5):
        assert failed_login(server).status_code == 401
    server.clock.now += 30
    for _ in range(5):
        assert failed_login(server).status_code == 401
    server.clock.now += 29
    assert failed_login(server).status_code == 429  # all ten are inside the last minute
    server.clock.now += 2  # the first five are now older than a minute
    for _ in range(5):
        assert failed_login(server).status_code == 401
    assert failed_login(server, KEY).status_code == 429


def test_limits_are_per_client_and_memory_stays_bounded() -> None:
    clock = FakeClock()
    auth = ApiKeyAuth(lambda: KEY, clock=clock)
    limiter = auth.login_limiter
    for _ in range(10):
        with pytest.raises(AuthenticationError):
            auth.login("wrong", "10.0.0.1")
    with pytest.raises(RateLimitedError):
        auth.login(KEY, "10.0.0.1")
    assert auth.login(KEY, "10.0.0.2")  # another client is not affected
    # Many guessing clients: only the most recent MAX_TRACKED_CLIENTS are remembered.
    for n in range(3000):
        with pytest.raises(AuthenticationError):
            auth.login("wrong", f"10.1.{n // 256}.{n % 256}")
    assert limiter.tracked_clients() == limiter.max_clients == 1024
    # Clients quiet for a whole window are forgotten at the next failure.
    clock.now += 61
    with pytest.raises(AuthenticationError):
        auth.login("wrong", "10.0.0.3")
    assert limiter.tracked_clients() == 1


# --- check_bind -------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_binds_need_no_key(host: str) -> None:
    check_bind(host, None, allow_unauthenticated_remote=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "my-mac.local"])
def test_remote_bind_without_key_is_refused(host: str) -> None:
    with pytest.raises(SettingsError) as info:
        check_bind(host, None, allow_unauthenticated_remote=False)
    message = info.value.message
    assert "server.api_key" in message
    assert "--api-key" in message
    assert "server.allow_unauthenticated_remote" in message
    assert "--allow-unauthenticated-remote" in message


def test_remote_bind_with_empty_key_is_refused() -> None:
    with pytest.raises(SettingsError):
        check_bind("0.0.0.0", "", allow_unauthenticated_remote=False)


def test_remote_bind_allowed_with_key_or_flag() -> None:
    check_bind("0.0.0.0", KEY, allow_unauthenticated_remote=False)
    check_bind("0.0.0.0", None, allow_unauthenticated_remote=True)


# --- log redaction ------------------------------------------------------------------


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


RedactedLog = tuple[logging.Logger, ListHandler, dict[str, str | None]]


@pytest.fixture
def redacted_log() -> Iterator[RedactedLog]:
    current: dict[str, str | None] = {"key": KEY}
    handler = ListHandler()
    handler.addFilter(RedactKeyFilter(lambda: current["key"]))
    logger = logging.getLogger("omlx.test_auth.redaction")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield logger, handler, current
    logger.removeHandler(handler)


def test_redaction_hides_the_key_in_messages(redacted_log: RedactedLog) -> None:
    logger, handler, _ = redacted_log
    logger.info("settings saved: api_key=%s port=%d", KEY, 8000)
    assert handler.lines == ["settings saved: api_key=*** port=8000"]


def test_redaction_hides_the_key_in_tracebacks(redacted_log: RedactedLog) -> None:
    logger, handler, _ = redacted_log
    try:
        raise ValueError(f"bad key {KEY}")
    except ValueError:
        logger.exception("failed")
    assert handler.lines
    assert KEY not in handler.lines[0]
    assert "bad key ***" in handler.lines[0]


def test_redaction_follows_key_changes(redacted_log: RedactedLog) -> None:
    logger, handler, current = redacted_log
    current["key"] = "sk-newer"
    logger.info("old %s new %s", KEY, "sk-newer")
    assert handler.lines == [f"old {KEY} new ***"]
