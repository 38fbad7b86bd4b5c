"""The router's configuration: its backends (URL and optional key) and its knobs.

Keys are kept out of ``repr`` and logs: a backend is shown by its URL only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from omlx.errors import SettingsError
from omlx.settings import ROUTER_BACKEND_KEYS_ENV


@dataclass(frozen=True, slots=True)
class BackendSpec:
    url: str  # normalised: scheme://host:port, no trailing slash or /v1
    key: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    backends: tuple[BackendSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str | None = field(default=None, repr=False)
    allow_unauthenticated_remote: bool = False
    # Health, load and models are polled this often from every backend.
    poll_interval_s: float = 2.0
    # Consecutive failed polls before a backend is taken out (a refused
    # connection while proxying takes it out at once).
    unhealthy_after: int = 2
    # Release/resume fan-out: each backend gets this long, all in parallel.
    fanout_timeout_s: float = 120.0
    # Prefix affinity: characters of canonical prompt text per block, and the
    # number of block hashes remembered (least recently used forgotten first).
    affinity_block_chars: int = 512
    affinity_max_entries: int = 100_000
    # Affinity yields to least-loaded when its backend has this many more
    # requests in flight than the least loaded one (a hot prefix must not pile up).
    affinity_max_extra_load: int = 4
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 32 * 1024 * 1024

    def spec(self, url: str) -> BackendSpec | None:
        return next((b for b in self.backends if b.url == url), None)


def normalise_url(raw: str) -> str:
    """``http://host:port`` from what a user types (a trailing ``/`` or ``/v1`` is dropped)."""
    url = raw.strip().rstrip("/")
    url = url.removesuffix("/v1").rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(
            f"backend {raw!r} is not a URL: give it as http://HOST:PORT", param="--backend"
        )
    if parts.query or parts.fragment or parts.path or parts.username or parts.password:
        raise SettingsError(
            f"backend {raw!r}: give only scheme, host and port (http://HOST:PORT); "
            "pass its key with --backend-key URL=KEY",
            param="--backend",
        )
    return url


def parse_backend_keys(pairs: list[str], env_json: str | None) -> dict[str, str]:
    """``URL=KEY`` pairs (flags) over ``{"URL": "KEY"}`` (the environment)."""
    keys: dict[str, str] = {}
    if env_json:
        try:
            loaded = json.loads(env_json)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"{ROUTER_BACKEND_KEYS_ENV} is not JSON: {exc.msg}") from exc
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise SettingsError(f'{ROUTER_BACKEND_KEYS_ENV} must be a JSON object {{"URL": "KEY"}}')
        keys.update({normalise_url(u): k for u, k in loaded.items()})
    for pair in pairs:
        url, sep, key = pair.partition("=")
        if not sep or not key:
            raise SettingsError(
                "--backend-key takes URL=KEY (e.g. http://127.0.0.1:8001=sk-...)",
                param="--backend-key",
            )
        keys[normalise_url(url)] = key
    return keys


def build_backends(urls: list[str], keys: dict[str, str]) -> tuple[BackendSpec, ...]:
    """Backends in the order given; each key must name one of them."""
    if not urls:
        raise SettingsError("give at least one --backend URL", param="--backend")
    normalised = [normalise_url(u) for u in urls]
    duplicates = sorted({u for u in normalised if normalised.count(u) > 1})
    if duplicates:
        raise SettingsError(f"backend given twice: {', '.join(duplicates)}", param="--backend")
    unknown = sorted(set(keys) - set(normalised))
    if unknown:
        raise SettingsError(
            f"--backend-key for {', '.join(unknown)}, which is not a --backend",
            param="--backend-key",
        )
    return tuple(BackendSpec(u, keys.get(u)) for u in normalised)
