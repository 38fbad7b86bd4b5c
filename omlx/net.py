"""Network checks shared by ``omlx serve`` and the desktop app (stdlib only, so the
menu-bar process can import it without the server's dependencies)."""

from __future__ import annotations

import socket


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (TIME_WAIT leftovers of an
    earlier server do not count as taken, as uvicorn binds with SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
