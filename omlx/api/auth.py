"""Optional API key: header checks, admin sessions, bind safety, log redaction.

With no key set everything is open; the bind check keeps that to loopback unless
the user opts in. The key is always read through ``key_fn`` so a change made in
the admin settings takes effect at once (and invalidates existing sessions).
Logins are rate limited per client, and the session table is bounded in size and
expires idle sessions, so neither guessing nor piling up sessions costs memory.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request, Response

from omlx.errors import AuthenticationError, InvalidRequestError, RateLimitedError, SettingsError

log = logging.getLogger(__name__)

SESSION_COOKIE = "omlx_session"
DEFAULT_SESSION_TTL_S = 7 * 24 * 3600.0
# A session unused this long ends even before its TTL (a forgotten browser tab).
DEFAULT_SESSION_IDLE_S = 12 * 3600.0
# The panel needs one session per browser; more than this and the least recently used goes.
MAX_SESSIONS = 64
# Failed logins allowed per client in a sliding window; then 429 until the oldest ages out.
MAX_FAILED_LOGINS = 10
FAILED_LOGIN_WINDOW_S = 60.0
# Clients whose failures are remembered; beyond it the longest-quiet client is forgotten.
MAX_TRACKED_CLIENTS = 1024
_HOW_TO_SEND = "send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


@dataclass(slots=True)
class _Session:
    expires_at: float
    key_digest: bytes
    last_used_at: float


class LoginLimiter:
    """Counts failed logins per client in a sliding window; memory stays bounded
    (at most ``max_clients`` clients with ``max_failures`` timestamps each)."""

    def __init__(
        self,
        clock: Callable[[], float],
        max_failures: int = MAX_FAILED_LOGINS,
        window_s: float = FAILED_LOGIN_WINDOW_S,
        max_clients: int = MAX_TRACKED_CLIENTS,
    ):
        self._clock = clock
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients
        # Least recently failing client first, so the cap drops the quietest one.
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, client: str) -> None:
        """Raise RateLimitedError while ``client`` has used up its failures."""
        now = self._clock()
        with self._lock:
            recent = self._recent(client, now)
            if len(recent) < self.max_failures:
                return
            retry_after_s = max(1, math.ceil(recent[0] + self.window_s - now))
        raise RateLimitedError(
            f"too many failed logins from {client}: at most {self.max_failures} per "
            f"{self.window_s:g} s; try again in {retry_after_s} s",
            retry_after_s=retry_after_s,
        )

    def record_failure(self, client: str) -> None:
        now = self._clock()
        with self._lock:
            recent = self._recent(client, now)
            recent.append(now)
            self._failures[client] = recent
            self._failures.move_to_end(client)
            self._forget_quiet_clients(now)

    def _forget_quiet_clients(self, now: float) -> None:
        """Drop clients with no failure in the window, then any over the cap; lock held."""
        while self._failures:
            quietest, failures = next(iter(self._failures.items()))
            if failures[-1] > now - self.window_s and len(self._failures) <= self.max_clients:
                return
            del self._failures[quietest]

    def tracked_clients(self) -> int:
        with self._lock:
            return len(self._failures)

    def _recent(self, client: str, now: float) -> deque[float]:
        """The client's failures inside the window (older ones dropped); lock held."""
        recent = self._failures.get(client, deque(maxlen=self.max_failures))
        while recent and recent[0] <= now - self.window_s:
            recent.popleft()
        if not recent:
            self._failures.pop(client, None)
        return recent


class ApiKeyAuth:
    """Checks requests against the current key; keeps admin sessions in memory."""

    def __init__(
        self,
        key_fn: Callable[[], str | None],
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        clock: Callable[[], float] = time.time,
        *,
        session_idle_s: float = DEFAULT_SESSION_IDLE_S,
        max_sessions: int = MAX_SESSIONS,
    ):
        self._key_fn = key_fn
        self.session_ttl_s = session_ttl_s
        self.session_idle_s = session_idle_s
        self.max_sessions = max_sessions
        self._clock = clock
        self.login_limiter = LoginLimiter(clock)
        # Keyed by a digest of the token, so raw tokens are not kept around.
        self._sessions: dict[bytes, _Session] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._key_fn())

    def check_api(self, request: Request) -> None:
        """Raise AuthenticationError unless auth is off, a header carries the key, or
        the admin panel's login session cookie (httpOnly, SameSite=Strict) is valid."""
        if not self.enabled:
            return
        token = request.cookies.get(SESSION_COOKIE)
        if token and self._session_valid(token):
            return
        offered = _offered_keys(request)
        if not offered:
            raise AuthenticationError(f"missing API key; {_HOW_TO_SEND}")
        if not any(self._matches(k) for k in offered):
            raise AuthenticationError(f"invalid API key; {_HOW_TO_SEND}")

    def check_admin(self, request: Request) -> None:
        """Like check_api, but a valid ``omlx_session`` cookie is enough too."""
        if not self.enabled or self.authenticated(request):
            return
        raise AuthenticationError(
            f"admin requires the API key: log in, or {_HOW_TO_SEND}", code="admin_login_required"
        )

    def authenticated(self, request: Request) -> bool:
        """True only when a key is set and the request proves it (a header or a session)."""
        if not self.enabled:
            return False
        token = request.cookies.get(SESSION_COOKIE)
        if token and self._session_valid(token):
            return True
        return any(self._matches(k) for k in _offered_keys(request))

    def login(self, offered_key: str, client: str = "unknown") -> str:
        """A new session token if ``offered_key`` is the current key.

        Raises RateLimitedError (even for the right key) while ``client`` has too
        many recent failures, so guessing costs a minute per ten tries.
        """
        self.login_limiter.check(client)
        key_digest = self._key_digest()
        if key_digest is None or not hmac.compare_digest(_digest(offered_key.encode()), key_digest):
            self.login_limiter.record_failure(client)
            raise AuthenticationError("invalid API key")
        token = secrets.token_urlsafe(32)
        now = self._clock()
        with self._lock:
            self._drop_expired(now)
            while len(self._sessions) >= self.max_sessions:
                self._drop_least_recently_used()
            self._sessions[_digest(token.encode())] = _Session(
                now + self.session_ttl_s, key_digest, last_used_at=now
            )
        return token

    def session_count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def logout(self, token: str) -> None:
        with self._lock:
            self._sessions.pop(_digest(token.encode()), None)

    def _key_digest(self) -> bytes | None:
        key = self._key_fn()
        return _digest(key.encode()) if key else None

    def _matches(self, offered: bytes) -> bool:
        key_digest = self._key_digest()
        # Digests have a fixed length, so the comparison does not leak the key's length.
        return key_digest is not None and hmac.compare_digest(_digest(offered), key_digest)

    def _session_valid(self, token: str) -> bool:
        """Whether ``token`` is a live session for the current key; marks it used."""
        key_digest = self._key_digest()
        if key_digest is None:
            return False
        now = self._clock()
        with self._lock:
            token_digest = _digest(token.encode())
            session = self._sessions.get(token_digest)
            if session is None:
                return False
            if self._expired(session, now):
                del self._sessions[token_digest]
                return False
            if not hmac.compare_digest(session.key_digest, key_digest):
                return False
            session.last_used_at = now
            return True

    def _expired(self, session: _Session, now: float) -> bool:
        return session.expires_at <= now or session.last_used_at + self.session_idle_s <= now

    def _drop_expired(self, now: float) -> None:
        expired = [t for t, s in self._sessions.items() if self._expired(s, now)]
        for t in expired:
            del self._sessions[t]

    def _drop_least_recently_used(self) -> None:
        oldest = min(self._sessions, key=lambda t: self._sessions[t].last_used_at)
        del self._sessions[oldest]


def _offered_keys(request: Request) -> list[bytes]:
    """Keys offered in headers, as raw bytes (Starlette decodes headers as latin-1)."""
    offered = []
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        offered.append(value.strip().encode("latin-1"))
    x_api_key = request.headers.get("x-api-key", "").strip()
    if x_api_key:
        offered.append(x_api_key.encode("latin-1"))
    return offered


async def require_api_key(request: Request) -> None:
    """Dependency for API routes: ``dependencies=[Depends(require_api_key)]``."""
    auth: ApiKeyAuth = request.app.state.auth
    auth.check_api(request)


async def require_admin(request: Request) -> None:
    """Dependency for admin routes: the key, or a session cookie from login."""
    auth: ApiKeyAuth = request.app.state.auth
    auth.check_admin(request)


async def _read_offered_key(request: Request) -> str:
    try:
        body = await request.json()
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidRequestError("request body is not valid JSON") from exc
    key = body.get("api_key") if isinstance(body, dict) else None
    if not isinstance(key, str) or not key:
        raise InvalidRequestError(
            'send a JSON body {"api_key": "<key>"} with a non-empty string', param="api_key"
        )
    return key


def login_router() -> APIRouter:
    """``POST /admin/api/login`` and ``POST /admin/api/logout`` (session cookie)."""
    router = APIRouter()

    @router.post("/admin/api/login")
    async def login(request: Request, response: Response) -> dict[str, bool]:
        auth: ApiKeyAuth = request.app.state.auth
        if not auth.enabled:
            return {"ok": True}  # nothing to log in to; admin is open
        offered = await _read_offered_key(request)
        client = request.client.host if request.client else "unknown"
        try:
            token = auth.login(offered, client)
        except AuthenticationError:
            log.warning("admin login with a wrong API key from %s", client)
            raise
        except RateLimitedError:
            log.warning("admin login refused: too many failed logins from %s", client)
            raise
        response.set_cookie(
            SESSION_COOKIE,
            token,
            max_age=int(auth.session_ttl_s),
            path="/",
            httponly=True,
            samesite="strict",
        )
        return {"ok": True}

    @router.post("/admin/api/logout")
    async def logout(request: Request, response: Response) -> dict[str, bool]:
        auth: ApiKeyAuth = request.app.state.auth
        token = request.cookies.get(SESSION_COOKIE)
        if token:
            auth.logout(token)
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return {"ok": True}

    return router


def is_loopback_host(host: str) -> bool:
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False  # a hostname other than localhost may resolve anywhere
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def check_bind(host: str, api_key: str | None, allow_unauthenticated_remote: bool) -> None:
    """Refuse to serve beyond loopback without a key unless explicitly allowed."""
    if api_key or allow_unauthenticated_remote or is_loopback_host(host):
        return
    raise SettingsError(
        f"refusing to listen on {host!r} without an API key: anyone on the network could "
        "use the server. Set server.api_key (or --api-key), or set "
        "server.allow_unauthenticated_remote (or --allow-unauthenticated-remote) to accept that.",
        param="server.host",
    )


class RedactKeyFilter(logging.Filter):
    """Replaces the current key with ``***`` in records; attach it to handlers."""

    def __init__(self, key_fn: Callable[[], str | None]):
        super().__init__()
        self._key_fn = key_fn

    def filter(self, record: logging.LogRecord) -> bool:
        key = self._key_fn()
        if not key:
            return True
        try:
            message = record.getMessage()
        except Exception:
            return True  # a malformed call; let the handler report it as usual
        if key in message:
            record.msg, record.args = message.replace(key, "***"), None
        if record.exc_info and not record.exc_text:
            # Formatters reuse exc_text, so the traceback is redacted too.
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = record.exc_text.replace(key, "***")
        if record.stack_info:
            record.stack_info = record.stack_info.replace(key, "***")
        return True
