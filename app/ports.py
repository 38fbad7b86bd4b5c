"""Who holds a port: nobody, another omlx, or some other program."""

from __future__ import annotations

import enum
import socket
from dataclasses import dataclass

import httpx

from omlx.net import port_is_free  # the same test as `omlx serve`


class PortUse(enum.Enum):
    FREE = "free"
    OMLX = "omlx"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class PortProbe:
    use: PortUse
    version: str = ""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def omlx_version(base_url: str, timeout_s: float = 2.0) -> str | None:
    """The version an omlx server reports on /health, or None if it is not omlx."""
    try:
        body = httpx.get(base_url + "/health", timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return None
    if isinstance(body, dict) and body.get("status") == "ok" and "loaded_models" in body:
        return str(body.get("version", "?"))
    return None


def probe_port(host: str, port: int) -> PortProbe:
    if port_is_free(host, port):
        return PortProbe(PortUse.FREE)
    version = omlx_version(f"http://{url_host(host)}:{port}")
    if version is not None:
        return PortProbe(PortUse.OMLX, version)
    return PortProbe(PortUse.OTHER)


def url_host(host: str) -> str:
    """Where the shell connects: a wildcard bind is reached over loopback."""
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
