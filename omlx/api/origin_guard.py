"""Which web pages may reach the server: the first thing every request meets.

omlx listens on the user's own machine while the same user browses the web, so
any page can send it requests. This middleware refuses what only a hostile page
would send, before any route (or the body guard) sees the request:

- a ``Host`` that is not this server's (DNS rebinding: a page whose name was
  re-pointed at 127.0.0.1 is same-origin with us, but still says its own name);
- a state-changing request (POST/PUT/PATCH/DELETE) from a foreign ``Origin`` or
  with ``Sec-Fetch-Site: cross-site`` (only ``server.cors_origins`` may, on /v1 and /api);
- a state-changing request that is not JSON: a ``<form>`` or a ``no-cors`` fetch
  can only send text/plain, form or multipart bodies and no custom header, so a
  JSON content type (or, without a body, ``X-Omlx-Client`` or an API-key header)
  proves the sender is a real client;
- a state-changing request authorized by the login cookie alone without
  ``X-Omlx-Client``: cookies ignore ports, so another localhost port carries it.

Every response also gets the panel's security headers (CSP, no framing).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import psutil
from fastapi.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omlx.api.auth import SESSION_COOKIE, is_loopback_host
from omlx.api.errors import is_json_type, omlx_error_response
from omlx.errors import ForbiddenError, OmlxError, UnsupportedMediaTypeError

CLIENT_HEADER = "X-Omlx-Client"
# The inference APIs a listed site may call cross-site: OpenAI/Anthropic's and Ollama's.
CORS_PREFIXES = ("/v1", "/api")
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_HOST = re.compile(r"^(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[^:\[\]/@\s]+))(?::\d{1,5})?$")
_DEFAULT_PORTS = {"http": 80, "https": 443}
# The panel loads only its own files; no inline script or style, no framing. Images
# may be data: URLs (the Chat page shows the images a message attaches).
SECURITY_HEADERS = {
    b"content-security-policy": (
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
        b"frame-ancestors 'none'"
    ),
    b"x-frame-options": b"DENY",
    b"x-content-type-options": b"nosniff",
    b"referrer-policy": b"no-referrer",
}


class OriginGuardMiddleware:
    """``bind_host`` is the address the server listens on; the lists are read per
    request, so a changed setting applies at once."""

    def __init__(
        self,
        app: ASGIApp,
        bind_host: str,
        allowed_hosts_fn: Callable[[], list[str]],
        cors_origins_fn: Callable[[], list[str]],
    ):
        self.app = app
        self._bind_name = host_name(bind_host)
        self._loopback_only = is_loopback_host(bind_host)
        self._allowed_hosts_fn = allowed_hosts_fn
        self._cors_origins_fn = cors_origins_fn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_security_headers(send)
        try:
            host = self._checked_host(scope)
            if scope["method"] in _STATE_CHANGING:
                self._check_origin(scope, host)
                _check_client(scope)
        except OmlxError as exc:
            await omlx_error_response(Request(scope), exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _checked_host(self, scope: Scope) -> str:
        """The request's Host header (as sent) if it names this server."""
        raw = _header(scope, b"host")
        name = host_name(raw)
        if name is None or not self._host_allowed(name):
            shown = raw or "(none)"
            raise ForbiddenError(
                f"the Host {shown!r} is not a name of this server, so the request was "
                "refused (a web page may be posing as it: DNS rebinding). If you reach "
                "omlx by that name, add it to server.allowed_hosts",
                code="host_not_allowed",
            )
        return raw

    def _host_allowed(self, name: str) -> bool:
        if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
            return True
        if name in self._allowed_hosts_fn():  # normalised by the settings' validator
            return True
        if self._loopback_only:
            return False
        if name == self._bind_name and name not in ("0.0.0.0", "::"):
            return True
        return name in _machine_names() or _is_own_ip(name)

    def _check_origin(self, scope: Scope, host: str) -> None:
        origin = _header(scope, b"origin")
        fetch_site = _header(scope, b"sec-fetch-site").lower()
        if origin and self._cors_allowed(scope, origin):
            return  # a listed site, on /v1 or /api: cross-site by design
        own = _origin_key(f"{scope['scheme']}://{host}")
        if origin and (own is None or _origin_key(origin) != own):
            raise ForbiddenError(
                f"cross-site request from {origin!r} refused: only this server's own pages "
                "may change its state. To let a site call /v1 or /api, add its origin to "
                "server.cors_origins",
                code="cross_site_request",
            )
        if fetch_site == "cross-site":
            raise ForbiddenError(
                "cross-site request refused (Sec-Fetch-Site: cross-site)",
                code="cross_site_request",
            )

    def _cors_allowed(self, scope: Scope, origin: str) -> bool:
        path: str = scope["path"]
        if not is_cors_path(path):
            return False
        allowed = self._cors_origins_fn()
        key = _origin_key(origin)
        return "*" in allowed or (key is not None and key in {_origin_key(o) for o in allowed})


def _check_client(scope: Scope) -> None:
    """A JSON body; without a body, JSON or a header no web page can send unasked."""
    content_type = _header(scope, b"content-type")
    has_client_header = bool(_header(scope, CLIENT_HEADER.lower().encode()).strip())
    # A page cannot add these (nor X-Omlx-Client) cross-site without a CORS preflight.
    has_key_header = bool(_header(scope, b"authorization") or _header(scope, b"x-api-key"))
    if _has_body(scope) and not is_json_type(content_type):
        raise UnsupportedMediaTypeError(
            "send the body as JSON with 'Content-Type: application/json' "
            f"(got {content_type or 'none'!r})"
        )
    if not (is_json_type(content_type) or has_client_header or has_key_header):
        raise UnsupportedMediaTypeError(
            f"a {scope['method']} without a body needs 'Content-Type: application/json' "
            f"or an '{CLIENT_HEADER}' header (a web page cannot send either unasked)"
        )
    # Cookies ignore ports: a page on another localhost port would carry the login.
    if not has_key_header and not has_client_header and SESSION_COOKIE in Request(scope).cookies:
        raise ForbiddenError(
            f"a request authorized by the login cookie must carry an '{CLIENT_HEADER}' "
            "header (the admin panel sends it); other clients send the API key instead",
            code="client_header_required",
        )


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length").strip()
    return bool(_header(scope, b"transfer-encoding")) or (length not in ("", "0"))


def host_name(host: str) -> str | None:
    """The lower-cased name or address in a Host header (port and brackets gone);
    None when it is empty or not a host at all."""
    match = _HOST.match(host.strip().lower())
    if match is None:
        return None
    name: str = match.group("v6") or match.group("name")
    try:
        return str(ipaddress.ip_address(name))  # one spelling per address ("::1")
    except ValueError:
        return name


def _origin_key(origin: str) -> tuple[str, str, int | None] | None:
    try:
        parts = urlsplit(origin.strip().lower())
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname:
        return None  # "null" (sandboxed frames, file: pages) is nobody's origin
    return parts.scheme, parts.hostname, port


@lru_cache(maxsize=1)
def _machine_names() -> frozenset[str]:
    """This machine's names; looked up once (getfqdn may ask DNS)."""
    short = socket.gethostname().lower()
    names = {short, socket.getfqdn().lower(), short.split(".")[0] + ".local"}
    return frozenset(n for n in names if n)


def _is_own_ip(name: str) -> bool:
    """Read each time: interface addresses change (Wi-Fi, VPN, DHCP)."""
    try:
        wanted = ipaddress.ip_address(name)
    except ValueError:
        return False
    return wanted in set(_interface_addresses(psutil.net_if_addrs().values()))


def _interface_addresses(
    interfaces: Iterable[list[Any]],
) -> Iterable[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    for addresses in interfaces:
        for addr in addresses:
            if addr.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    yield ipaddress.ip_address(addr.address.split("%", 1)[0])
                except ValueError:
                    continue


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return ""


def _with_security_headers(send: Send) -> Send:
    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            present = {k.lower() for k, _ in message.get("headers", [])}
            extra = [(k, v) for k, v in SECURITY_HEADERS.items() if k not in present]
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return send_with_headers


def is_cors_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in CORS_PREFIXES)


class PathScopedCORS:
    """CORS for ``/v1`` and ``/api`` only: the admin panel and the rest stay same-origin."""

    def __init__(self, app: ASGIApp, origins: list[str]):
        self.app = app
        self.cors = CORSMiddleware(
            app, allow_origins=origins, allow_methods=["*"], allow_headers=["*"]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and is_cors_path(path):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
